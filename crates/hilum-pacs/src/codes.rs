//! The coded concepts the result objects use (PS3.3 Code Sequence Macro, Table 8.8-1), with the
//! coding schemes of PS3.16: `DCM` (DICOM, PS3.16 Annex D), `SCT` (SNOMED CT), `UCUM` (units),
//! `UMLS`, `RFC5646` (languages).
//!
//! Every standard code here was checked against the concept tables of PS3.16 (as pydicom 3.0.2
//! ships them, `pydicom.sr._concepts_dict`) except the two lung sides, Right lung (3341006, SCT)
//! and Left lung (44029006, SCT), which are SNOMED CT body structures used by the
//! segmentation property type contexts (CID 7151 via its anatomic included groups).
//!
//! Where the standard has no concept, the private coding scheme `99HILUM` is used (PS3.3
//! 8.2.1: designators starting with `99` are private). Its codes, all defined here:
//!
//! | code | meaning | why private |
//! |---|---|---|
//! | `CTR` | Cardiothoracic ratio | LOINC 59076-0 is the cardiothoracic *area* ratio; Hilum's CTR is the ratio of widths |
//! | `AGENT_ANSWER` | Agent answer | the reasoning agent's free-text answer |
//! | `AGENT_QUESTION` | Agent question | the question the protocol asked |
//! | `MODEL` | Model | one model's id and sha256, as text |
//! | `F_*` | the classifier label | findings without an SCT/DCM concept in PS3.16 (Atelectasis, Consolidation, Emphysema, Pneumonia, ...) |

use serde::{Deserialize, Serialize};

/// A coded concept: value, coding scheme designator, meaning.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Code {
    /// Code Value (0008,0100), e.g. `42798000`.
    pub value: String,
    /// Coding Scheme Designator (0008,0102), e.g. `SCT`.
    pub scheme: String,
    /// Code Meaning (0008,0104), e.g. `Area`.
    pub meaning: String,
}

impl Code {
    /// A code from its value, scheme and meaning.
    pub fn new(value: &str, scheme: &str, meaning: &str) -> Self {
        Self {
            value: value.to_string(),
            scheme: scheme.to_string(),
            meaning: meaning.to_string(),
        }
    }
}

/// The private coding scheme designator of Hilum's own concepts.
pub const PRIVATE_SCHEME: &str = "99HILUM";

macro_rules! codes {
    ($($(#[$doc:meta])* $name:ident = ($value:literal, $scheme:literal, $meaning:literal);)*) => {
        $(
            $(#[$doc])*
            pub fn $name() -> Code {
                Code::new($value, $scheme, $meaning)
            }
        )*
    };
}

codes! {
    // Document structure (TID 1500, 1501, 1600, 1204, 1001-1004, 4019).
    /// TID 1500 document title (CID 7021).
    imaging_measurement_report = ("126000", "DCM", "Imaging Measurement Report");
    /// TID 1204 concept name of the document's language.
    language_of_content = ("121049", "DCM", "Language of Content Item and Descendants");
    /// The document's language: English (United States).
    english_us = ("en-US", "RFC5646", "English (United States)");
    /// TID 1002 concept name of the observer's type (person or device).
    observer_type = ("121005", "DCM", "Observer Type");
    /// Observer type value: the observer is a device (TID 1002).
    device = ("121007", "DCM", "Device");
    /// TID 1004 row: the device observer's UID.
    device_observer_uid = ("121012", "DCM", "Device Observer UID");
    /// TID 1004 row: the device observer's name.
    device_observer_name = ("121013", "DCM", "Device Observer Name");
    /// TID 1004 row: the device observer's manufacturer.
    device_observer_manufacturer = ("121014", "DCM", "Device Observer Manufacturer");
    /// TID 1004 row: the device observer's model name.
    device_observer_model_name = ("121015", "DCM", "Device Observer Model Name");
    /// TID 1004 row: the device observer's serial number.
    device_observer_serial_number = ("121016", "DCM", "Device Observer Serial Number");
    /// TID 1500 row: the imaging procedure the report is about.
    procedure_reported = ("121058", "DCM", "Procedure reported");
    /// TID 1600 container listing the source images.
    image_library = ("111028", "DCM", "Image Library");
    /// TID 1600 group of library entries sharing their attributes.
    image_library_group = ("126200", "DCM", "Image Library Group");
    /// TID 1500 container of the measurement groups.
    imaging_measurements = ("126010", "DCM", "Imaging Measurements");
    /// TID 1501 container of one measurement group.
    measurement_group = ("125007", "DCM", "Measurement Group");
    /// TID 1501 row: a measurement group's human-readable name.
    tracking_identifier = ("112039", "DCM", "Tracking Identifier");
    /// TID 1501 row: a measurement group's UID.
    tracking_unique_identifier = ("112040", "DCM", "Tracking Unique Identifier");
    /// TID 1501 row: what a measurement group is about.
    finding = ("121071", "DCM", "Finding");
    /// TID 1501 row: the anatomy a measurement group is about.
    finding_site = ("363698007", "SCT", "Finding Site");
    /// TID 4019 row: the name of the model that produced a result.
    algorithm_name = ("111001", "DCM", "Algorithm Name");
    /// TID 4019 row: the version of the model that produced a result.
    algorithm_version = ("111003", "DCM", "Algorithm Version");
    /// TID 1501 row "Source" image reference (the name highdicom writes and reads).
    source = ("260753009", "SCT", "Source");
    /// TID 1500 row 12 container of document-level qualitative evaluations.
    qualitative_evaluations = ("C0034375", "UMLS", "Qualitative Evaluations");
    /// A free-text comment row.
    comment = ("121106", "DCM", "Comment");
    /// CID 7162 algorithm family of the SEG's algorithm identification.
    artificial_intelligence = ("123110", "DCM", "Artificial Intelligence");
    /// Derivation of a SEG frame from its source image (CID 7203).
    segmentation_derivation = ("113076", "DCM", "Segmentation");
    /// Purpose of reference of a source image (CID 7202).
    source_image_for_processing = ("121322", "DCM", "Source image for image processing operation");

    // The procedure: a plain chest radiograph (SNOMED CT procedure, for CID 100's role).
    /// The procedure reported: a plain chest radiograph.
    plain_chest_xray = ("399208008", "SCT", "Plain chest X-ray");

    // Measurements.
    /// An area measurement.
    area = ("42798000", "SCT", "Area");
    /// PS3.16 Annex D (DCM) "Probability", a classifier's output in 0..1.
    probability = ("122157", "DCM", "Probability");
    /// Private: Hilum's cardiothoracic ratio (ratio of widths, not areas).
    cardiothoracic_ratio = ("CTR", "99HILUM", "Cardiothoracic ratio");
    /// Private: the reasoning agent's free-text answer.
    agent_answer = ("AGENT_ANSWER", "99HILUM", "Agent answer");
    /// Private: the question the protocol asked the agent.
    agent_question = ("AGENT_QUESTION", "99HILUM", "Agent question");
    /// Private: one model's id and sha256, as text.
    model = ("MODEL", "99HILUM", "Model");

    // Anatomy: segmentation property category (CID 7150) and types, finding sites.
    /// Segmentation property category of organs and body parts (CID 7150).
    anatomical_structure = ("91723000", "SCT", "Anatomical Structure");
    /// Both lungs, as one structure or finding site.
    lung = ("39607008", "SCT", "Lung");
    /// The right lung, as a structure or finding site.
    right_lung = ("3341006", "SCT", "Right lung");
    /// The left lung, as a structure or finding site.
    left_lung = ("44029006", "SCT", "Left lung");
    /// The heart, as a structure or finding site.
    heart = ("80891009", "SCT", "Heart");
    /// The mediastinum, as a structure or finding site.
    mediastinum = ("72410000", "SCT", "Mediastinum");

    // UCUM units (CID 7181).
    /// Unit: square millimetres.
    mm2 = ("mm2", "UCUM", "square millimeter");
    /// Unit: pixels (an area without pixel spacing).
    pixels = ("{pixels}", "UCUM", "pixels");
    /// Unit: none (a ratio or probability).
    no_units = ("1", "UCUM", "no units");
}

/// The coded concept for a classifier label. Labels with a concept in PS3.16 get it (SCT or
/// DCM); the others get a `99HILUM` code `F_<LABEL>` (up to 16 characters, a hash suffix for
/// long labels) whose meaning is the label.
pub fn finding_code(label: &str) -> Code {
    let normalised: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                ' '
            }
        })
        .collect::<String>()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let standard = match normalised.as_str() {
        "pneumothorax" => Some(("36118008", "SCT", "Pneumothorax")),
        "edema" | "pulmonary edema" => Some(("19242006", "SCT", "Pulmonary edema")),
        "effusion" | "pleural effusion" => Some(("60046008", "SCT", "Pleural effusion")),
        "cardiomegaly" => Some(("287272002", "SCT", "Cardiomegaly")),
        "nodule" => Some(("27925004", "SCT", "Nodule")),
        "mass" => Some(("4147007", "SCT", "Mass")),
        "fibrosis" => Some(("112674009", "SCT", "Fibrosis")),
        "infiltration" | "infiltrate" => Some(("112121", "DCM", "Infiltrate")),
        "opacity" => Some(("112001", "DCM", "Opacity")),
        _ => None,
    };
    if let Some((value, scheme, meaning)) = standard {
        return Code::new(value, scheme, meaning);
    }
    // CodeValue is SH (16 characters): FINDING_ and up to 8 of the label, or, for a longer
    // label, a hash suffix keeping codes of different labels different.
    let key: String = normalised.replace(' ', "_").to_ascii_uppercase();
    let value = if key.len() <= 8 {
        format!("F_{key}")
    } else {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(key.as_bytes());
        let short: String = key.chars().take(7).collect();
        format!(
            "F_{short}_{:02X}{:02X}{:02X}",
            digest[0], digest[1], digest[2]
        )
    };
    let meaning: String = label.chars().take(64).collect();
    Code::new(&value, PRIVATE_SCHEME, &meaning)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifier_labels_get_standard_codes_where_they_exist() {
        assert_eq!(finding_code("Effusion").value, "60046008");
        assert_eq!(finding_code("Pleural_Thickening").scheme, PRIVATE_SCHEME);
        assert_eq!(finding_code("Edema"), finding_code("pulmonary edema"));
    }

    #[test]
    fn private_finding_codes_fit_sh_and_differ() {
        let labels = [
            "Atelectasis",
            "Consolidation",
            "Emphysema",
            "Pneumonia",
            "Pleural_Thickening",
            "Hernia",
            "Lung Lesion",
            "Fracture",
            "Lung Opacity",
            "Enlarged Cardiomediastinum",
            "Enlarged Cardiomediastinum 2",
        ];
        let codes: Vec<Code> = labels.iter().map(|l| finding_code(l)).collect();
        for (code, label) in codes.iter().zip(labels) {
            assert!(code.value.len() <= 16, "{code:?}");
            assert_eq!(code.meaning, label);
        }
        let mut values: Vec<&str> = codes.iter().map(|c| c.value.as_str()).collect();
        values.sort();
        values.dedup();
        assert_eq!(values.len(), labels.len());
    }
}
