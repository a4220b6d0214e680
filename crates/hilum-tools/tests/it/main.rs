//! The crate's integration tests, one binary (one link, one set of codegen units): each
//! module is one former test file; run one with `cargo test -p hilum-tools --test it MODULE::`.

mod anatomy_measure;
mod anatomy_segment;
mod classify_onnx;
mod kserve_triton;
mod localize_cam;
mod multi_device;
mod report;
mod segment_lungs;
mod segment_region;
mod vlm_native;
mod vlm_served;
