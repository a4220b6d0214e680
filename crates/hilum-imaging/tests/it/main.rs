//! The crate's integration tests, one binary (one link, one set of codegen units): each
//! module is one former test file; run one with `cargo test -p hilum-imaging --test it MODULE::`.

mod bad_input;
mod deid_annex_e;
mod jpeg_pillow;
mod real_data;
mod store_deid;
mod voi_lut;
mod xrv_parity;
