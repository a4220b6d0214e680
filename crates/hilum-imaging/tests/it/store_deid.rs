//! The store (compute-once variants, bounded memory, ids only) and de-identified export.

use std::path::PathBuf;
use std::sync::{Arc, Barrier};

use bytes::Bytes;
use dicom_core::{DataElement, PrimitiveValue, VR};
use dicom_dictionary_std::tags;
use hilum_imaging::{
    decode_with, export_deidentified, read_dicom, DecodeOptions, DeidOptions, Fit, ImageStore,
    ImagingError, Norm, Preprocess, StoreLimits, Voi,
};

fn data(rel: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/cxr")
        .join(rel);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "real test data missing: {} ({e}); it lives beside the repository",
            path.display()
        )
    })
}

#[test]
fn concurrent_requests_compute_a_variant_once() {
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_bytes(Bytes::from(data("images/covid_2c35005f.jpg")), "covid.jpg")
        .unwrap();
    let before = store.stats();
    assert_eq!(before.decodes, 1);
    let n = 8;
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (store, id, barrier) = (store.clone(), id.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                store.prepared(&id, &Preprocess::xrv(224)).unwrap()
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(results.iter().all(|r| Arc::ptr_eq(r, &results[0])));
    let s = store.stats();
    assert_eq!(s.variants_computed, 1, "{s:?}");
    assert_eq!(s.decodes, 1, "{s:?}");
    assert_eq!(results[0].shape(), [1, 224, 224]);
    let (lo, hi) = results[0]
        .data
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    assert!(
        lo >= -1024.0 && hi <= 1024.0 && hi - lo > 1000.0,
        "{lo}..{hi}"
    );
    // A different recipe is a different variant.
    store.prepared(&id, &Preprocess::imagenet(224)).unwrap();
    assert_eq!(store.stats().variants_computed, 2);
}

#[test]
fn cache_stays_within_budget_and_recomputes_after_eviction() {
    // Room for about one decoded 1024x1024 image (4 MiB of f32).
    let store = ImageStore::new(StoreLimits {
        cache_bytes: 5 << 20,
        ..Default::default()
    });
    let a = store
        .ingest_bytes(
            Bytes::from(data("images/nih_00009745_000_cardiomegaly.png")),
            "a.png",
        )
        .unwrap();
    let b = store
        .ingest_bytes(
            Bytes::from(data("images/nih_00015649_000_mass.png")),
            "b.png",
        )
        .unwrap();
    let s = store.stats();
    assert!(s.cached_bytes <= 5 << 20, "{s:?}");
    assert!(s.evictions >= 1, "{s:?}");
    // Evicted, but still there: decoded again from the kept source.
    let img = store.get(&a).unwrap();
    assert_eq!((img.width, img.height), (1024, 1024));
    assert_eq!(store.stats().decodes, 3);
    assert!(store.get(&b).is_ok());
    assert!(store.stats().cached_bytes <= 5 << 20);
}

#[test]
fn ids_are_content_addressed_and_paths_do_not_resolve() {
    let store = ImageStore::default();
    let bytes = data("images/nih_00000001_000_cardiomegaly.png");
    let id = store
        .ingest_bytes(Bytes::from(bytes.clone()), "x.png")
        .unwrap();
    assert_eq!(id, ImageStore::id_for(&bytes));
    assert_eq!(
        store.ingest_bytes(Bytes::from(bytes), "again.png").unwrap(),
        id
    );
    assert_eq!(store.ids(), vec![id]);
    for bad in ["../../etc/passwd", "/etc/passwd", "images/x.png", "img_zzz"] {
        assert!(
            matches!(store.get(bad), Err(ImagingError::UnknownId(_))),
            "{bad}"
        );
        assert!(matches!(
            store.prepared(bad, &Preprocess::xrv(64)),
            Err(ImagingError::UnknownId(_))
        ));
    }
}

#[test]
fn dicom_ingest_and_store_default_window() {
    let store = ImageStore::default();
    let id = store
        .ingest_bytes(
            Bytes::from(data("dicom/RG1_chest_cr_pa_jpeg2000_lossy.dcm")),
            "rg1.dcm",
        )
        .unwrap();
    let img = store.get(&id).unwrap();
    assert_eq!(img.meta.window_applied, Some((15000.0, 30000.0)));
    assert_eq!((img.width, img.height), (1841, 1955));
}

#[test]
fn mask_maps_back_onto_the_original_image() {
    // A lung-U-Net-style 256 px stretched variant of a non-square image, and a padded one:
    // a map that is 1 on the variant's left half must cover the original's left half.
    let img = decode_with(
        &data("images/medrax_effusion1.png"),
        "effusion1.png",
        &DecodeOptions::default(),
    )
    .unwrap();
    assert_eq!((img.width, img.height), (512, 624));
    let store = ImageStore::default();
    let id = store
        .ingest_bytes(Bytes::from(data("images/medrax_effusion1.png")), "e.png")
        .unwrap();
    for fit in [Fit::Stretch, Fit::Pad] {
        let p = store
            .prepared(
                &id,
                &Preprocess::stretch(256, 256).fit(fit).norm(Norm::Byte),
            )
            .unwrap();
        let (cx, _) = p.geometry.to_input(256.0, 0.0);
        let half: Vec<f32> = (0..256 * 256)
            .map(|i| if ((i % 256) as f64) < cx { 1.0 } else { 0.0 })
            .collect();
        let back = p.geometry.map_to_original(&half);
        assert_eq!(back.len(), 512 * 624);
        let left = (0..624).all(|y| back[y * 512 + 100] > 0.99);
        let right = (0..624).all(|y| back[y * 512 + 400] < 0.01);
        assert!(left && right, "{fit:?}");
        let [x0, y0, x1, y1] = p.geometry.box_to_original([0.0, 0.0, 256.0, 256.0]);
        assert_eq!([x0, y0, x1, y1], [0.0, 0.0, 512.0, 624.0], "{fit:?}");
    }
}

/// Adds identifying values to a real file so the test knows exactly what must disappear.
fn with_phi(rel: &str) -> (Vec<u8>, Vec<String>) {
    let bytes = data(rel);
    let mut obj = dicom_object::from_reader(&bytes[..]).unwrap();
    let phi = [
        (tags::PATIENT_NAME, VR::PN, "DOE^JANE^Q"),
        (tags::PATIENT_ID, VR::LO, "MRN-99812345"),
        (tags::PATIENT_BIRTH_DATE, VR::DA, "19581223"),
        (tags::PATIENT_ADDRESS, VR::LO, "12 Elm Street Springfield"),
        (tags::INSTITUTION_NAME, VR::LO, "Saint Example Hospital"),
        (tags::REFERRING_PHYSICIAN_NAME, VR::PN, "HOUSE^GREGORY"),
        (tags::PERFORMING_PHYSICIAN_NAME, VR::PN, "CAMERON^ALLISON"),
        (tags::OPERATORS_NAME, VR::PN, "TECH^TOM"),
        (tags::ACCESSION_NUMBER, VR::SH, "ACC7781234"),
        (tags::STUDY_DATE, VR::DA, "20190704"),
        (
            tags::STUDY_INSTANCE_UID,
            VR::UI,
            "1.2.826.0.1.3680043.2.1125.777.1",
        ),
        (
            tags::SERIES_INSTANCE_UID,
            VR::UI,
            "1.2.826.0.1.3680043.2.1125.777.2",
        ),
        (tags::STUDY_DESCRIPTION, VR::LO, "CHEST for DOE JANE"),
    ];
    for (tag, vr, v) in phi {
        obj.put(DataElement::new(tag, vr, PrimitiveValue::from(v)));
    }
    let mut values: Vec<String> = phi.iter().map(|(_, _, v)| v.to_string()).collect();
    // The file's own instance UID must go too.
    values.push(
        obj.get(tags::SOP_INSTANCE_UID)
            .unwrap()
            .to_str()
            .unwrap()
            .trim_end_matches('\0')
            .to_string(),
    );
    let mut out = Vec::new();
    obj.write_all(&mut out).unwrap();
    (out, values)
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn deidentified_export_contains_none_of_the_original_phi() {
    let opts = DeidOptions {
        salt: "test-salt".into(),
        date_shift_days: Some(-100),
        retain_patient_characteristics: true,
        ..Default::default()
    };
    for rel in [
        "dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm",
        "dicom/RG1_chest_cr_pa_jpeg2000_lossy.dcm",
    ] {
        let (original, phi) = with_phi(rel);
        for v in &phi {
            assert!(contains(&original, v), "fixture must contain {v}");
        }
        let (out, report) = export_deidentified(&original, rel, &opts).unwrap();
        for v in &phi {
            assert!(
                !contains(&out, v),
                "{rel}: exported file still contains `{v}`"
            );
        }
        // Parts of names must not survive either.
        for part in ["DOE", "JANE", "GREGORY", "Springfield", "99812345"] {
            assert!(!contains(&out, part), "{rel}: `{part}` survived");
        }
        assert!(report.uids_remapped >= 3, "{report:?}");
        let back = dicom_object::from_reader(&out[..]).unwrap();
        let text = |t| back.get(t).map(|e| e.to_str().unwrap().trim().to_string());
        assert_eq!(text(tags::PATIENT_IDENTITY_REMOVED).as_deref(), Some("YES"));
        assert_eq!(text(tags::STUDY_DATE).as_deref(), Some("20190326"));
        // Emptied (the table's Z).
        assert_eq!(text(tags::PATIENT_BIRTH_DATE).as_deref(), Some(""));
        // Consistent: the same salt gives the same new study UID.
        let (again, _) = export_deidentified(&original, rel, &opts).unwrap();
        let back2 = dicom_object::from_reader(&again[..]).unwrap();
        assert_eq!(
            back.get(tags::STUDY_INSTANCE_UID)
                .unwrap()
                .to_str()
                .unwrap(),
            back2
                .get(tags::STUDY_INSTANCE_UID)
                .unwrap()
                .to_str()
                .unwrap()
        );
        // Pixels untouched.
        let o = decode_with(
            &original,
            rel,
            &DecodeOptions {
                voi: Voi::None,
                ..Default::default()
            },
        )
        .unwrap();
        let d = decode_with(
            &out,
            rel,
            &DecodeOptions {
                voi: Voi::None,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(o.pixels, d.pixels);
        // The summary shown to models names no PHI values.
        let s = read_dicom(&out, rel).unwrap();
        let json = serde_json::to_string(&s).unwrap();
        for v in &phi {
            assert!(!json.contains(v.as_str()));
        }
    }
}

#[test]
fn file_without_file_meta_exports_as_part10() {
    let (out, report) = export_deidentified(
        &data("dicom/CR-MONO1-10-chest_noPart10header.dcm"),
        "cr.dcm",
        &DeidOptions::default(),
    )
    .unwrap();
    assert_eq!(&out[128..132], b"DICM");
    assert!(report.warnings.iter().any(|w| w.contains("File Meta")));
    let img = decode_with(&out, "cr.dcm", &DecodeOptions::default()).unwrap();
    assert_eq!((img.width, img.height, img.meta.bit_depth), (440, 440, 10));
}

#[test]
fn loader_store_evicts_whole_images_and_reloads_the_same_pixels() {
    use std::collections::HashMap;
    use std::sync::Mutex;
    // The "database": every file ever ingested, by id; it counts fetches.
    let files: Arc<Mutex<HashMap<String, Bytes>>> = Arc::default();
    let fetches = Arc::new(Mutex::new(0usize));
    let loader: hilum_imaging::ImageLoader = {
        let (files, fetches) = (files.clone(), fetches.clone());
        Arc::new(move |id: &str| {
            *fetches.lock().unwrap() += 1;
            Ok(files.lock().unwrap().get(id).cloned())
        })
    };
    let names = [
        "images/nih_00009745_000_cardiomegaly.png",
        "images/nih_00015649_000_mass.png",
        "images/nih_00000284_000_hernia.png",
    ];
    // Room for the largest image (pixels and file), never for two.
    let sizes: Vec<u64> = names
        .iter()
        .map(|n| {
            let s = ImageStore::default();
            let bytes = data(n);
            s.ingest_bytes(Bytes::from(bytes.clone()), n).unwrap();
            s.stats().cached_bytes + bytes.len() as u64
        })
        .collect();
    let budget = *sizes.iter().max().unwrap();
    assert!(sizes.iter().all(|s| s * 2 > budget), "{sizes:?}");
    let store = ImageStore::with_loader(
        StoreLimits {
            cache_bytes: budget,
            ..Default::default()
        },
        loader,
    );
    let mut ids = Vec::new();
    for n in names {
        let bytes = Bytes::from(data(n));
        files
            .lock()
            .unwrap()
            .insert(ImageStore::id_for(&bytes), bytes.clone());
        ids.push(store.ingest_bytes(bytes, n).unwrap());
    }
    let first = decode_with(&data(names[0]), "a", &DecodeOptions::default()).unwrap();
    let s = store.stats();
    assert_eq!(s.resident_images, 1, "{s:?}");
    assert!(s.cached_bytes + s.source_bytes <= budget, "{s:?}");
    assert!(s.images_evicted >= 2, "{s:?}");
    assert!(!store.is_resident(&ids[0]));
    // Evicted ids stay listed.
    let mut all = ids.clone();
    all.sort();
    assert_eq!(store.ids(), all);
    // Naming an evicted image fetches it again: same id, same pixels.
    let img = store.get(&ids[0]).unwrap();
    assert_eq!(img.pixels, first.pixels);
    assert_eq!(store.stats().reloads, 1);
    assert!(store.is_resident(&ids[0]));
    assert_eq!(store.stats().resident_images, 1);
    // An Arc held across an eviction stays valid.
    store.get(&ids[1]).unwrap();
    assert!(!store.is_resident(&ids[0]));
    assert_eq!(img.pixels, first.pixels);
    // Asked for again while a caller still holds it, the evicted image is the same copy (the
    // file is fetched again, the pixels are not decoded again).
    let decodes = store.stats().decodes;
    let again = store.get(&ids[0]).unwrap();
    assert!(Arc::ptr_eq(&again, &img));
    let s = store.stats();
    assert_eq!((s.decodes, s.reattached), (decodes, 1), "{s:?}");
    assert!(s.cached_bytes + s.source_bytes <= budget, "{s:?}");
    // Once nobody holds it, an evicted image is decoded afresh.
    drop((again, img));
    store.get(&ids[1]).unwrap();
    assert!(!store.is_resident(&ids[0]));
    let decodes = store.stats().decodes;
    let img = store.get(&ids[0]).unwrap();
    assert_eq!(store.stats().decodes, decodes + 1);
    assert_eq!(store.stats().reattached, 1);
    assert_eq!(img.pixels, first.pixels);
    // Ids the loader does not know stay unknown; bytes that do not match the id are refused.
    assert!(matches!(
        store.get("img_000000000000"),
        Err(ImagingError::UnknownId(_))
    ));
    files
        .lock()
        .unwrap()
        .insert(ids[2].clone(), Bytes::from(data(names[0])));
    assert!(!store.is_resident(&ids[2]));
    assert!(matches!(store.get(&ids[2]), Err(ImagingError::Io { .. })));
    assert!(*fetches.lock().unwrap() >= 2);
}
