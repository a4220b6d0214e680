//! The Keras `.h5` reader against files written by h5py (the HDF5 C library): the safetensors it
//! writes are byte for byte those of `scripts/convert_keras_h5.py` (fixtures from
//! `scripts/fixtures/make_keras_fixtures.py`, and the real lung U-Net in ../shared/data), and damaged
//! files give errors, never a panic.

use std::path::{Path, PathBuf};

use hilum_models::checkpoint::{keras_to_safetensors, read_keras_h5, CheckpointError};
use sha2::{Digest, Sha256};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/checkpoints")
}

fn lung_unet_h5() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/models/lung_seg_unet/lung_seg_valiou_088.h5");
    assert!(p.is_file(), "missing test data {}", p.display());
    p
}

fn convert(src: &Path) -> Vec<u8> {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out.safetensors");
    keras_to_safetensors(src, &out).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    std::fs::read(&out).expect("read output")
}

#[test]
fn fixtures_convert_to_the_python_converters_bytes() {
    for stem in ["keras_model", "keras_weights_latest"] {
        let got = convert(&fixtures().join(format!("{stem}.h5")));
        let want = std::fs::read(fixtures().join(format!("{stem}.expected.safetensors")))
            .expect("expected file");
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            panic!(
                "{stem}: {} bytes vs {} expected, first difference at {at:?}\n got: {}",
                got.len(),
                want.len(),
                String::from_utf8_lossy(&got[..got.len().min(600)])
            );
        }
    }
}

#[test]
fn fixture_weights_are_cast_and_named_as_keras_stores_them() {
    let w = read_keras_h5(&fixtures().join("keras_model.h5")).expect("read");
    let get = |name: &str| {
        &w.tensors
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no {name}"))
            .1
    };
    assert_eq!(get("conv1.kernel").shape, [3, 3, 2, 4], "HWIO kept");
    assert_eq!(get("dense.kernel").shape, [40, 30], "chunked + gzip");
    assert_eq!(
        get("scale.alpha").shape,
        [1],
        "a scalar becomes [1], as numpy makes it"
    );
    assert_eq!(
        get("block.kernel").shape,
        [2, 2],
        "nested group, last name kept"
    );
    assert_eq!(get("couche_é.w").shape, [3]);
    assert!(w.tensors.iter().all(|(n, _)| !n.starts_with("input_1")));
    assert_eq!(
        w.metadata,
        [
            ("converted_from".to_string(), "keras-h5".to_string()),
            ("keras_version".to_string(), "2.2.4-tf".to_string()),
            ("backend".to_string(), "tensorflow".to_string()),
        ]
    );
}

/// The Python converter's output for the real file, made with h5py 3.12.1 / numpy 2.1.3:
/// `convert_keras_h5.py lung_seg_valiou_088.h5 out.safetensors` (162 tensors, 174007 values).
const LUNG_UNET_PYTHON_SHA256: &str =
    "e5fa1ca031c59900e6331083334b42eed070b28ffb4bee4f438da1724872d22f";

#[test]
fn real_lung_unet_converts_to_the_python_converters_bytes() {
    let got = convert(&lung_unet_h5());
    assert_eq!(
        format!("{:x}", Sha256::digest(&got)),
        LUNG_UNET_PYTHON_SHA256
    );
    let w = read_keras_h5(&lung_unet_h5()).expect("read");
    assert_eq!(w.tensors.len(), 162);
    let values: usize = w.tensors.iter().map(|(_, t)| t.data.len()).sum();
    assert_eq!(values, 174_007);
}

fn assert_clear_error(what: &str, r: Result<impl std::fmt::Debug, CheckpointError>) {
    let e = r.expect_err(what);
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            CheckpointError::Malformed(_)
                | CheckpointError::Limit(_)
                | CheckpointError::Unsupported(_)
        ) && msg.len() > 20,
        "{what}: {msg}"
    );
}

#[test]
fn truncated_and_garbled_files_are_errors_not_panics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("damaged.h5");
    let out = dir.path().join("out.safetensors");
    for src in [fixtures().join("keras_model.h5"), lung_unet_h5()] {
        let bytes = std::fs::read(&src).expect("read");
        // Cut short anywhere before the last weight: an error.
        for cut in (0..bytes.len() * 9 / 10).step_by((bytes.len() / 50).max(1)) {
            std::fs::write(&path, &bytes[..cut]).expect("write");
            assert_clear_error(&format!("{} cut at {cut}", src.display()), {
                keras_to_safetensors(&path, &out)
            });
        }
        // Not an HDF5 file at all.
        let mut b = bytes.clone();
        b[..8].copy_from_slice(b"NOTHDF5!");
        std::fs::write(&path, &b).expect("write");
        let e = keras_to_safetensors(&path, &out).expect_err("bad magic");
        assert!(e.to_string().contains("not a readable HDF5 file"), "{e}");
        // A garbled superblock (addresses and sizes after the signature).
        let mut b = bytes.clone();
        for (i, x) in b[8..96].iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(151).wrapping_add(7);
        }
        std::fs::write(&path, &b).expect("write");
        assert_clear_error("garbled superblock", keras_to_safetensors(&path, &out));
    }
}

/// Random damage anywhere: either outcome is fine; a panic or a hang is not.
#[test]
fn randomly_damaged_files_never_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("damaged.h5");
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for stem in ["keras_model", "keras_weights_latest"] {
        let bytes = std::fs::read(fixtures().join(format!("{stem}.h5"))).expect("read");
        for _ in 0..300 {
            let mut b = bytes.clone();
            for _ in 0..1 + next() % 8 {
                let i = (next() % b.len() as u64) as usize;
                b[i] = next() as u8;
            }
            std::fs::write(&path, &b).expect("write");
            let _ = read_keras_h5(&path);
        }
    }
}
