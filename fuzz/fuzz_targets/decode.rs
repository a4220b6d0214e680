//! Any bytes through the decoder entry point, the DICOM summary and the de-identified export:
//! an error is fine, a panic, an abort or an allocation past the budget is a bug.
#![no_main]

use hilum_imaging::{
    decode_with, export_deidentified, prepare, read_dicom, DecodeOptions, DeidOptions, Preprocess,
    Voi,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let opts = DecodeOptions {
        max_pixels: 4_000_000,
        voi: Voi::FromFile,
    };
    if let Ok(img) = decode_with(data, "fuzz", &opts) {
        assert_eq!(img.pixels.len(), img.width as usize * img.height as usize);
        assert!(img.width as u64 * img.height as u64 <= opts.max_pixels);
        let _ = prepare(&img, &Preprocess::xrv(32));
    }
    let _ = read_dicom(data, "fuzz");
    let deid = DeidOptions {
        salt: "fuzz".into(),
        date_shift_days: Some(-7),
        keep_age_sex: false,
    };
    let _ = export_deidentified(data, "fuzz", &deid);
});
