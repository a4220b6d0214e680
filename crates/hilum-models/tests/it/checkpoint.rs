//! The PyTorch checkpoint reader against files written by torch and torchxrayvision themselves
//! (`scripts/fixtures/make_checkpoint_fixtures.py`, fixtures in `tests/fixtures/checkpoints/`): values
//! equal torch's own `.to(float32)`, converted files equal the Python converters' output tensor
//! for tensor, and malicious pickles are refused by name without anything running.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hilum_models::checkpoint::{
    pytorch_to_safetensors, Attribute, Checkpoint, CheckpointError, Content, Tensor,
};

/// The PyTorch reading rules of an architecture in Hilum's table.
fn renames(arch: &str) -> hilum_models::architecture::Renames {
    hilum_models::Architectures::builtin()
        .get(arch)
        .and_then(|a| a.pytorch_renames())
        .expect("a PyTorch reader")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/checkpoints")
}

/// name → (shape, values) of a safetensors file of f32 tensors.
fn load_safetensors(path: &Path) -> BTreeMap<String, Tensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let data = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let shape = view.shape().to_vec();
            (name, Tensor { shape, data })
        })
        .collect()
}

fn read_all(name: &str) -> BTreeMap<String, Tensor> {
    let mut ckpt = Checkpoint::open(&fixtures().join(name)).expect(name);
    let tensors = ckpt.tensors(&[], |k| Some(k.to_string())).expect(name);
    let n = tensors.len();
    let map: BTreeMap<_, _> = tensors.into_iter().collect();
    assert_eq!(map.len(), n, "{name}: duplicate names");
    map
}

/// Bit-for-bit equal (NaN-free fixtures), with the first difference named.
fn assert_same(what: &str, got: &BTreeMap<String, Tensor>, want: &BTreeMap<String, Tensor>) {
    let got_names: Vec<_> = got.keys().collect();
    let want_names: Vec<_> = want.keys().collect();
    assert_eq!(got_names, want_names, "{what}: names differ");
    for (name, w) in want {
        let g = &got[name];
        assert_eq!(g.shape, w.shape, "{what}: shape of {name}");
        assert_eq!(g.data, w.data, "{what}: values of {name}");
    }
}

#[test]
fn zip_and_legacy_state_dicts_equal_torch_float32() {
    let want = load_safetensors(&fixtures().join("state_dict.expected.safetensors"));
    assert!(want.len() >= 12, "fixture has the dtype and view cases");
    for file in ["state_dict_zip.pt", "state_dict_legacy.pt"] {
        let got = read_all(file);
        assert_same(file, &got, &want);
        // Views keep their own shapes: a transpose, a strided slice, a scalar, an expand.
        assert_eq!(got["proj.weight_t"].shape, vec![6, 4], "{file}");
        assert_eq!(got["proj.cols"].shape, vec![3, 2], "{file}");
        assert!(got["proj.scalar"].shape.is_empty(), "{file}");
        assert_eq!(got["expand"].shape, vec![3, 4], "{file}");
        assert_eq!(got["empty"].data.len(), 0, "{file}");
        assert_eq!(got["mask"].data, vec![1.0, 0.0, 1.0], "{file}");
        assert_eq!(got["norm.num_batches_tracked"].data, vec![7.0], "{file}");
        let content = Checkpoint::open(&fixtures().join(file))
            .expect(file)
            .content();
        assert_eq!(content, Content::Dict, "{file}");
    }
}

#[test]
fn whole_pickled_module_flattens_like_state_dict_in_both_formats() {
    // module.expected.safetensors is scripts/convert_xrv.py's output for module_zip.pt.
    let want = load_safetensors(&fixtures().join("module.expected.safetensors"));
    assert!(want.contains_key("features.denseblock1.denselayer1.norm1.weight"));
    for file in ["module_zip.pt", "module_legacy.pt"] {
        let path = fixtures().join(file);
        let mut ckpt = Checkpoint::open(&path).expect(file);
        assert_eq!(
            ckpt.content(),
            Content::Module("torchxrayvision.models.DenseNet".into())
        );
        let all: BTreeMap<_, _> = ckpt
            .tensors(&[], |k| Some(k.to_string()))
            .expect(file)
            .into_iter()
            .collect();
        // BN counters are in the state dict; the non-persistent buffer is not.
        assert_eq!(all["features.norm0.num_batches_tracked"].data, vec![11.0]);
        assert!(!all.keys().any(|k| k.contains("scratch")), "{file}");
        assert!(all.contains_key("op_threshs"), "{file}");

        let attrs: BTreeMap<_, _> = ckpt.attributes().expect(file).into_iter().collect();
        assert_eq!(
            attrs.get("pathologies"),
            Some(&Attribute::Data(serde_json::json!([
                "Atelectasis",
                "Effusion",
                "Mass"
            ]))),
            "{file}"
        );
        assert_eq!(
            attrs.get("features.relu0.inplace"),
            Some(&Attribute::Data(serde_json::json!(true))),
            "{file}"
        );

        let out = tempfile::tempdir().expect("tempdir");
        let dst = out.path().join("model.safetensors");
        let n = pytorch_to_safetensors(&renames("densenet121"), &path, &dst).expect(file);
        let got = load_safetensors(&dst);
        assert_eq!(n, got.len());
        assert_same(file, &got, &want);
    }
}

#[test]
fn converter_metadata_matches_convert_xrv() {
    let out = tempfile::tempdir().expect("tempdir");
    let dst = out.path().join("m.safetensors");
    pytorch_to_safetensors(
        &renames("resnet50"),
        &fixtures().join("module_zip.pt"),
        &dst,
    )
    .expect("convert");
    let bytes = std::fs::read(&dst).expect("read");
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).expect("header");
    let meta = meta.metadata().clone().unwrap_or_default();
    assert_eq!(
        meta.get("source").map(String::as_str),
        Some("module_zip.pt")
    );
    assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
}

#[test]
fn pspnet_conversion_equals_convert_pspnet() {
    let want = load_safetensors(&fixtures().join("pspnet.expected.safetensors"));
    assert!(want
        .keys()
        .all(|k| !k.starts_with("module.") && !k.starts_with("aux_cls.")));
    let out = tempfile::tempdir().expect("tempdir");
    let dst = out.path().join("p.safetensors");
    pytorch_to_safetensors(
        &renames("pspnet"),
        &fixtures().join("pspnet_state.pth"),
        &dst,
    )
    .expect("convert");
    assert_same("pspnet", &load_safetensors(&dst), &want);
}

#[test]
fn sam_conversion_follows_convert_medsam_rules() {
    let want = load_safetensors(&fixtures().join("sam.expected.safetensors"));
    let out = tempfile::tempdir().expect("tempdir");
    let dst = out.path().join("s.safetensors");
    pytorch_to_safetensors(&renames("sam"), &fixtures().join("sam_state.pth"), &dst)
        .expect("convert");
    assert_same("sam", &load_safetensors(&dst), &want);
}

/// Each malicious fixture, the global its error must name, and the marker its payload creates
/// when Python unpickles it (the generator proves that).
const EVIL: &[(&str, &str, &str)] = &[
    ("evil_os_system.pkl", "os.system", "os_system"),
    ("evil_posix_system.pkl", "posix.system", "posix_system"),
    ("evil_eval.pkl", "builtins.eval", "eval"),
    ("evil_popen.pkl", "subprocess.Popen", "popen"),
    ("evil_getattr.pkl", "builtins.getattr", "getattr"),
    ("evil_nested_zip.pt", "posix.system", "nested_zip"),
    ("evil_nested_legacy.pt", "posix.system", "nested_legacy"),
];

#[test]
fn malicious_pickles_are_refused_by_name_and_nothing_runs() {
    for (file, global, marker) in EVIL {
        let marker = PathBuf::from(format!("/tmp/hilum-ckpt-marker-{marker}"));
        let _ = std::fs::remove_file(&marker);
        let path = fixtures().join(file);
        let err = match file.ends_with(".pkl") {
            // Bare pickles go through the same unpickler as a checkpoint's data.pkl.
            true => {
                hilum_models::checkpoint::parse_pickle(&std::fs::read(&path).expect(file)).err()
            }
            false => Checkpoint::open(&path).err(),
        };
        let err = err.unwrap_or_else(|| panic!("{file} was accepted"));
        assert!(
            matches!(err, CheckpointError::Refused { .. }),
            "{file}: {err}"
        );
        let msg = err.to_string();
        assert!(msg.contains(&format!("`{global}`")), "{file}: {msg}");
        // Give a payload that somehow ran in the background time to show itself.
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!marker.exists(), "{file}: {} was created", marker.display());
    }
}

#[test]
fn malicious_checkpoint_is_refused_by_the_converter_too() {
    let out = tempfile::tempdir().expect("tempdir");
    let dst = out.path().join("x.safetensors");
    let err = pytorch_to_safetensors(
        &renames("densenet121"),
        &fixtures().join("evil_nested_zip.pt"),
        &dst,
    )
    .expect_err("refused");
    assert!(err.to_string().contains("`posix.system`"), "{err}");
    assert!(!dst.exists());
}

/// xorshift64: seeded garbling without an RNG dependency.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn truncated_and_garbled_checkpoints_fail_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for file in [
        "state_dict_zip.pt",
        "state_dict_legacy.pt",
        "module_legacy.pt",
        "module_zip.pt",
    ] {
        let bytes = std::fs::read(fixtures().join(file)).expect(file);
        let path = dir.path().join(file);
        let mut tries: Vec<Vec<u8>> = Vec::new();
        for cut in (0..bytes.len()).step_by((bytes.len() / 40).max(1)) {
            tries.push(bytes[..cut].to_vec());
        }
        for _ in 0..60 {
            let mut b = bytes.clone();
            for _ in 0..1 + next(&mut seed) % 8 {
                let i = (next(&mut seed) % b.len() as u64) as usize;
                b[i] = next(&mut seed) as u8;
            }
            tries.push(b);
        }
        for b in tries {
            std::fs::write(&path, &b).expect("write");
            // Either outcome is fine; a panic or a hang is not.
            if let Ok(mut c) = Checkpoint::open(&path) {
                let _ = c.tensors(&[], |k| Some(k.to_string()));
                let _ = c.attributes();
            }
        }
    }
}

/// `hilum models import` reads PyTorch files itself: it gets as far as the architecture check
/// (the tiny fixture is not a full DenseNet-121), and a malicious file stops at the reader.
/// (crates/hilum-cli/tests/import_no_python.rs runs every manifest's import with no Python.)
#[test]
fn models_import_reads_pytorch_itself() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = hilum_models::ModelRegistry::new(dir.path()).expect("registry");
    let opts = hilum_models::ImportOptions::default();
    let file = fixtures().join("module_legacy.pt");
    let err = hilum_models::import(&reg, "densenet121-res224-all", &file, &opts)
        .expect_err("a tiny DenseNet is not the published one");
    let msg = err.to_string();
    assert!(
        matches!(err, hilum_models::ModelError::WeightsMismatch { .. }),
        "{msg}"
    );
    assert!(
        msg.contains("densenet121") && !msg.contains("python"),
        "{msg}"
    );

    let evil = fixtures().join("evil_nested_legacy.pt");
    let err = hilum_models::import(&reg, "chestx-det-pspnet", &evil, &opts).expect_err("refused");
    assert!(err.to_string().contains("`posix.system`"), "{err}");
}
