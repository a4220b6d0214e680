//! `dicom_info`: the de-identified DICOM metadata of an image (no PHI values, ever).

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool};
use hilum_imaging::{read_dicom, sniff_format, ImageStore, ImagingError};
use serde_json::json;

use crate::common::{run_blocking, ImageArgs};

/// The `dicom_info` tool: an image's de-identified DICOM metadata (view, spacing, window, …).
pub struct DicomInfo {
    store: Arc<ImageStore>,
}

impl DicomInfo {
    /// The tool, ready to register (its schema generated from its arguments' type).
    pub fn new(store: Arc<ImageStore>) -> Typed<Self> {
        Typed::new(DicomInfo { store })
    }
}

impl crate::BuildTool for DicomInfo {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(DicomInfo::new(deps.images.clone()))
    }
}

#[async_trait]
impl TypedTool for DicomInfo {
    type Args = ImageArgs;
    const NAME: &'static str = "dicom_info";

    fn description(&self) -> String {
        "De-identified DICOM metadata of an image: modality, SOP class, view position \
         (PA/AP/LL), laterality, body part, pixel spacing in mm, recommended window (centre/width) \
         and the window applied, bits stored, photometric interpretation, size, transfer syntax. \
         Use it to check the view before view-dependent measurements (e.g. cardiothoracic ratio \
         needs PA) or to convert pixels to millimetres. Contains no patient identifiers. \
         Fails for PNG/JPEG images (use image_info)."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            dicom_input: true,
            ..Requirements::NONE
        }
    }

    async fn run(&self, _ctx: &ToolContext, args: ImageArgs) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        let id = args.image.0;
        let (bytes, _) = self
            .store
            .source(&id)
            .map_err(|e| ToolError::NotFound(e.to_string()))?;
        if sniff_format(&bytes) != Some("dicom") {
            return Err(ToolError::Unprocessable(format!(
                "{id} is a {} image, not DICOM, so it has no DICOM metadata; use image_info",
                img.meta.format.to_uppercase()
            )));
        }
        // The file name is the user's; the model sees only the id.
        let s = run_blocking(move || {
            read_dicom(&bytes, "image")
                .map_err(|e: ImagingError| ToolError::Unprocessable(e.to_string()))
        })
        .await?;
        let m = &img.meta;
        let data = json!({
            "image": id,
            "modality": s.modality,
            "sop_class": s.sop_class_name.clone().or(s.sop_class.clone()),
            "view_position": s.view_position,
            "laterality": s.laterality,
            "patient_orientation": s.patient_orientation,
            "body_part": s.body_part,
            "manufacturer": s.manufacturer,
            "rows": s.rows,
            "columns": s.columns,
            "frames": s.frames,
            "bits_allocated": s.bits_allocated,
            "bits_stored": s.bits_stored,
            "photometric_interpretation": s.photometric,
            "inverted_for_display": m.inverted,
            "pixel_spacing_mm": s.pixel_spacing_mm.map(|(r, c)| json!({"row": r, "column": c})),
            "rescale": {"slope": s.rescale.0, "intercept": s.rescale.1},
            "windows": s.windows.iter().map(|(c, w)| json!({"center": c, "width": w})).collect::<Vec<_>>(),
            "window_applied": m.window_applied.map(|(c, w)| json!({"center": c, "width": w})),
            "voi_lut_function": s.voi_lut_function,
            "transfer_syntax": {"uid": s.transfer_syntax, "name": s.transfer_syntax_name},
            "burned_in_annotation": s.burned_in_annotation,
            // Which identifying attributes the source holds (names only): all stay on this machine.
            "identifying_attributes_withheld": s.phi_attributes_present,
            "warnings": s.warnings,
        });
        let spacing = match s.pixel_spacing_mm {
            Some((r, c)) => format!("pixel spacing {r:.3} x {c:.3} mm/px (row x column)"),
            None => "pixel spacing unknown".into(),
        };
        // Each value beside its attribute's name ("modality CR", "8 bits stored"): questions
        // name the attribute, and the answer then quotes the clause that holds it.
        let summary = format!(
            "{id}: DICOM, modality {}, body part {}, view position {}, {} x {} pixels (width x height), {} bits stored ({} allocated), photometric interpretation {}, {spacing}{}",
            s.modality.as_deref().unwrap_or("unknown"),
            s.body_part.as_deref().unwrap_or("unknown"),
            s.view_position.as_deref().unwrap_or("unknown"),
            s.columns,
            s.rows,
            s.bits_stored,
            s.bits_allocated,
            s.photometric.as_deref().unwrap_or("unknown"),
            match m.window_applied {
                Some((c, w)) => format!(", window {c}/{w} applied"),
                None => String::new(),
            }
        );
        Ok(ToolOutput::new(summary, data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn data(rel: &str) -> Vec<u8> {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/data/cxr")
            .join(rel);
        std::fs::read(&p)
            .unwrap_or_else(|e| panic!("real test data missing: {} ({e})", p.display()))
    }

    #[tokio::test]
    async fn reports_view_and_spacing_without_phi() {
        let store = Arc::new(ImageStore::default());
        let bytes = data("dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm");
        // Patient name and id of this file, and its study/instance UIDs (all identifying).
        let phi = [
            "16d7f894-55d7-4d95-8957-d18987f0e981",
            "1.2.276.0.7230010.3.1.2.8323329.6904.1517875201.850818",
            "1.2.276.0.7230010.3.1.4.8323329.6904.1517875201.850819",
        ];
        assert!(phi
            .iter()
            .all(|v| String::from_utf8_lossy(&bytes).contains(v)));
        let id = store.ingest_bytes(bytes.into(), "siim.dcm").unwrap();
        let tool = DicomInfo::new(store.clone());
        let out = tool
            .call(&ToolContext::default(), json!({"image": id}))
            .await
            .unwrap();
        assert_eq!(out.data["view_position"], "PA");
        assert_eq!(out.data["modality"], "CR");
        assert_eq!(out.data["pixel_spacing_mm"]["row"], 0.168);
        let text = format!("{} {}", out.summary, out.data);
        for v in phi {
            assert!(!text.contains(v), "`{v}` leaked");
        }
        assert!(out.data["identifying_attributes_withheld"]
            .as_array()
            .unwrap()
            .contains(&json!("PatientName")));
        let png = store
            .ingest_bytes(
                data("images/nih_00000001_000_cardiomegaly.png").into(),
                "x.png",
            )
            .unwrap();
        let err = tool
            .call(&ToolContext::default(), json!({"image": png}))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("image_info"), "{err}");
    }
}
