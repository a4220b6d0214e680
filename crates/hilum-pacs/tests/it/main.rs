//! Integration tests of hilum-pacs on the real radiographs in ../shared/data/cxr/dicom.

mod common;
mod readers;
mod sc;
mod scp;
mod seg;
mod source;
mod sr;
