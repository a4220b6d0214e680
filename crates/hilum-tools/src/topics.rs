//! What a chest X-ray question can ask about: the topics the coverage check matches questions
//! against ([`hilum_agent::coverage`]), with the plain words and synonyms radiologists and
//! patients use. Each tool declares which of these it answers; a topic no tool declares
//! (pneumoperitoneum, lines and tubes, …) is one Hilum says it cannot assess.

use hilum_agent::Topic;

macro_rules! topic {
    ($name:ident, $id:literal, $label:literal, [$($t:literal),* $(,)?]) => {
        #[doc = concat!("The `", $id, "` topic: ", $label, ".")]
        pub static $name: Topic = Topic { id: $id, label: $label, terms: &[$($t),*], answer_terms: &[] };
    };
    ($name:ident, $id:literal, $label:literal, [$($t:literal),* $(,)?], [$([$($a:literal),* $(,)?]),* $(,)?]) => {
        #[doc = concat!("The `", $id, "` topic: ", $label, ".")]
        pub static $name: Topic = Topic { id: $id, label: $label, terms: &[$($t),*], answer_terms: &[$(&[$($a),*]),*] };
    };
}

topic!(
    LUNG_SIZE,
    "lung_size",
    "the size of the lungs",
    [
        "lung+larg*",
        "lung+size",
        "lung+area",
        "lung+big*",
        "lung+small*",
        "lung+volume",
        "lung field+cover*",
        "lungs cover*",
    ],
    [["cover*"], ["area*", "px", "pixel*", "cm²", "mm²"]]
);
topic!(
    CTR,
    "ctr",
    "the cardiothoracic ratio",
    ["cardiothoracic", "cardio thoracic", "ctr",],
    [["ctr", "cardiothoracic"]]
);
topic!(
    CARDIOMEGALY,
    "cardiomegaly",
    "heart size (cardiomegaly)",
    [
        "cardiomegaly",
        "heart+enlarg*",
        "heart+big*",
        "heart+large*",
        "heart+size",
        "enlarged heart",
        "cardiac+enlarg*",
        "cardiac silhouette",
        "heart+normal size",
    ],
    [["cardiomegaly", "ctr", "cardiothoracic", "heart"]]
);
topic!(
    MEDIASTINUM,
    "mediastinum",
    "the mediastinum",
    ["mediastin*", "cardiomediastin*"]
);
topic!(
    EFFUSION,
    "effusion",
    "pleural effusion",
    ["effusion", "pleural fluid", "fluid", "costophrenic+blunt*",]
);
topic!(
    PNEUMOTHORAX,
    "pneumothorax",
    "pneumothorax",
    ["pneumothora*", "collapsed lung", "lung+collapse*", "ptx",]
);
topic!(NODULE, "nodule", "nodules", ["nodul*"]);
topic!(MASS, "mass", "masses", ["mass", "tumor*", "tumour*"]);
topic!(LESION, "lesion", "lung lesions", ["lesion*"]);
topic!(ATELECTASIS, "atelectasis", "atelectasis", ["atelecta*"]);
topic!(
    CONSOLIDATION,
    "consolidation",
    "consolidation",
    ["consolidat*"]
);
topic!(INFILTRATION, "infiltration", "infiltrates", ["infiltrat*"]);
topic!(
    EDEMA,
    "edema",
    "pulmonary edema",
    ["edema*", "oedema*", "congestion", "congestive"]
);
topic!(
    EMPHYSEMA,
    "emphysema",
    "emphysema",
    ["emphysem*", "copd", "hyperinflat*"]
);
topic!(
    FIBROSIS,
    "fibrosis",
    "fibrosis",
    ["fibros*", "fibrotic", "scarring"]
);
topic!(
    PNEUMONIA,
    "pneumonia",
    "pneumonia",
    ["pneumonia*", "infection"]
);
topic!(
    PLEURAL_THICKENING,
    "pleural_thickening",
    "pleural thickening",
    ["pleural thicken*", "thickened pleura", "pleura+thicken*",]
);
topic!(HERNIA, "hernia", "hernias", ["hernia*"]);
topic!(
    FRACTURE,
    "fracture",
    "fractures",
    ["fractur*", "broken rib*", "broken bone*"]
);
topic!(
    OPACITY,
    "opacity",
    "lung opacities",
    ["opacit*", "opacification"]
);
topic!(
    REPORT,
    "report",
    "findings for a radiology report",
    [
        "write+report",
        "generate+report",
        "draft+report",
        "radiology report",
        "report+finding*",
        "findings and impression",
        "dictate*",
    ],
    [["finding*", "impression", "report"]]
);
// Topics no Hilum tool answers (a VLM tool that takes free questions covers them).
topic!(
    DEVICES,
    "devices",
    "lines, tubes and devices",
    [
        "tube*",
        "catheter*",
        "pacemaker*",
        "picc",
        "central line*",
        "support device*",
        "endotracheal",
        "port a cath",
    ]
);
topic!(
    PNEUMOPERITONEUM,
    "pneumoperitoneum",
    "free air under the diaphragm",
    ["pneumoperitoneum", "free air", "free gas", "air+diaphragm",]
);
topic!(
    CALCIFICATION,
    "calcification",
    "calcifications",
    ["calcif*"]
);
topic!(
    TUBERCULOSIS,
    "tuberculosis",
    "tuberculosis",
    ["tuberculosis", "tb"]
);
topic!(COVID, "covid", "COVID-19", ["covid*", "coronavirus"]);
topic!(CAVITY, "cavity", "cavities", ["cavit*"]);

/// Every topic, the order answers list them in.
pub fn vocabulary() -> Vec<&'static Topic> {
    vec![
        &LUNG_SIZE,
        &CTR,
        &CARDIOMEGALY,
        &MEDIASTINUM,
        &EFFUSION,
        &PNEUMOTHORAX,
        &NODULE,
        &MASS,
        &LESION,
        &ATELECTASIS,
        &CONSOLIDATION,
        &INFILTRATION,
        &EDEMA,
        &EMPHYSEMA,
        &FIBROSIS,
        &PNEUMONIA,
        &PLEURAL_THICKENING,
        &HERNIA,
        &FRACTURE,
        &OPACITY,
        &REPORT,
        &DEVICES,
        &PNEUMOPERITONEUM,
        &CALCIFICATION,
        &TUBERCULOSIS,
        &COVID,
        &CAVITY,
    ]
}

/// The classifier's labels (torchxrayvision's 18) and the topic each answers.
pub const CLASSIFIER_LABELS: &[(&str, &Topic)] = &[
    ("Atelectasis", &ATELECTASIS),
    ("Consolidation", &CONSOLIDATION),
    ("Infiltration", &INFILTRATION),
    ("Pneumothorax", &PNEUMOTHORAX),
    ("Edema", &EDEMA),
    ("Emphysema", &EMPHYSEMA),
    ("Fibrosis", &FIBROSIS),
    ("Effusion", &EFFUSION),
    ("Pneumonia", &PNEUMONIA),
    ("Pleural_Thickening", &PLEURAL_THICKENING),
    ("Cardiomegaly", &CARDIOMEGALY),
    ("Nodule", &NODULE),
    ("Mass", &MASS),
    ("Hernia", &HERNIA),
    ("Lung Lesion", &LESION),
    ("Fracture", &FRACTURE),
    ("Lung Opacity", &OPACITY),
    ("Enlarged Cardiomediastinum", &MEDIASTINUM),
];

#[cfg(test)]
mod tests {
    use super::*;
    use hilum_agent::coverage::asked;

    fn ids(q: &str) -> Vec<&'static str> {
        asked(q, &vocabulary()).iter().map(|t| t.id).collect()
    }

    #[test]
    fn the_plain_questions_of_a_new_user_find_their_topics() {
        assert_eq!(ids("Is the heart enlarged?"), ["cardiomegaly"]);
        assert_eq!(ids("What is the cardiothoracic ratio?"), ["ctr"]);
        assert_eq!(ids("Are there any nodules?"), ["nodule"]);
        assert_eq!(ids("Is there a pleural effusion?"), ["effusion"]);
        assert_eq!(
            ids("Is there a pneumothorax on the left?"),
            ["pneumothorax"]
        );
        assert_eq!(ids("Write a short radiology report"), ["report"]);
        assert_eq!(ids("How large are the lungs in this image?"), ["lung_size"]);
        assert_eq!(ids("Is there fluid in the chest?"), ["effusion"]);
        assert_eq!(ids("Is the ET tube in a good position?"), ["devices"]);
        assert!(ids("What are the image dimensions?").is_empty());
    }

    #[test]
    fn every_classifier_label_has_a_topic_in_the_vocabulary() {
        let v = vocabulary();
        for (label, topic) in CLASSIFIER_LABELS {
            assert!(v.iter().any(|t| std::ptr::eq(*t, *topic)), "{label}");
        }
        assert_eq!(CLASSIFIER_LABELS.len(), 18);
    }
}
