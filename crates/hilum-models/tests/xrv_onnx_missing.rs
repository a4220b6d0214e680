//! Asking for the ONNX Runtime backend without ONNX Runtime configured is an error that names
//! the set-up script. Its own test binary: nothing in it calls `onnx::use_runtime`, whatever
//! ORT_DYLIB_PATH says, and the runtime is configured once per process.

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use hilum_models::xrv::{self, Classifier, XrvSpec};
use hilum_models::Backend;

#[test]
fn onnx_backend_without_onnx_runtime_names_the_setup_script() {
    let spec = XrvSpec {
        resolution: 64,
        ..XrvSpec::densenet121_res224_all()
    };
    let w = xrv::synthetic_weights(&spec.arch, 1).expect("weights");
    let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
    let err = Classifier::new(vb, spec, Backend::Onnx, 1)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("scripts/setup_onnxruntime.sh"), "{err}");
    assert!(err.contains("ORT_DYLIB_PATH"), "{err}");
}
