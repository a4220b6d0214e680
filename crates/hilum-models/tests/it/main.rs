//! The crate's integration tests, one binary (one link, one set of codegen units): each
//! module is one former test file; run one with `cargo test -p hilum-models --test it MODULE::`.

mod batching;
mod bn_folding;
mod checkpoint;
mod common;
mod fetch;
mod keras_h5;
mod llava_fixture;
mod lung_unet;
mod lung_unet_onnx;
mod medsam_fixture;
mod medsam_onnx;
mod multi_device;
mod pspnet_fixture;
mod pspnet_onnx;
mod report_fixture;
mod xrv_classifier;
mod xrv_onnx;
mod xrv_parity;
