//! Deterministic UIDs for result objects, so that sending the same results again replaces the
//! objects in the PACS instead of adding copies.
//!
//! A UID here is `2.25.` followed by the decimal value of the first 128 bits of a SHA-256 digest
//! (the UUID-derived root of PS3.5 B.2, which needs no registered organisation root). The
//! digest covers, each length-prefixed so that no two inputs share an encoding:
//! a version tag (`hilum-pacs uid v1`), the source StudyInstanceUID, the protocol name, the
//! object type (`sr`, `seg`, `sc`), the models (id and sha256, sorted by id), what the UID is
//! for (`series` or `instance`), and, for a SOP Instance UID, the source SOPInstanceUID (a study
//! may hold a PA and a lateral view: each gets its own objects, all in one series per type).
//! Any change of study, protocol, object type or model weights gives new UIDs; a resend of the
//! same run gives the same ones.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The kind of result object, one series per kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ObjectKind {
    /// The TID 1500 Comprehensive SR.
    Sr,
    /// The binary Segmentation.
    Seg,
    /// The derived Secondary Capture overlay.
    Sc,
}

impl ObjectKind {
    /// The kind as it enters the UID digest: `sr`, `seg` or `sc`.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectKind::Sr => "sr",
            ObjectKind::Seg => "seg",
            ObjectKind::Sc => "sc",
        }
    }
}

/// A model's identity as it enters UIDs and reports: its id and the sha256 of its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The model's id.
    pub id: String,
    /// Hex SHA-256 of the model's weights.
    pub sha256: String,
}

/// The Series and SOP Instance UIDs of one result object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResultUids {
    /// SeriesInstanceUID (0020,000E) of the object's series.
    pub series_instance_uid: String,
    /// SOPInstanceUID (0008,0018) of the object.
    pub sop_instance_uid: String,
}

impl ResultUids {
    /// The UIDs of the `kind` object made by `protocol` with `models` for the source instance
    /// `source_sop_instance_uid` of study `study_uid`.
    pub fn derive(
        study_uid: &str,
        source_sop_instance_uid: &str,
        protocol: &str,
        kind: ObjectKind,
        models: &[ModelInfo],
    ) -> Self {
        let mut sorted: Vec<&ModelInfo> = models.iter().collect();
        sorted.sort_by(|a, b| (&a.id, &a.sha256).cmp(&(&b.id, &b.sha256)));
        let mut base: Vec<&str> = vec![study_uid, protocol, kind.as_str()];
        for m in &sorted {
            base.push(&m.id);
            base.push(&m.sha256);
        }
        let series = [base.as_slice(), &["series"]].concat();
        let instance = [base.as_slice(), &["instance", source_sop_instance_uid]].concat();
        Self {
            series_instance_uid: derive_uid(&series),
            sop_instance_uid: derive_uid(&instance),
        }
    }
}

/// `2.25.` + the first 128 bits of SHA-256 over the length-prefixed `parts`, as a decimal
/// integer (at most 44 characters; no component has a leading zero).
pub fn derive_uid(parts: &[&str]) -> String {
    let mut hash = Sha256::new();
    hash.update(b"hilum-pacs uid v1");
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    format!("2.25.{}", u128::from_be_bytes(first))
}

/// A UID under another: `parent` (itself derived) and a name, e.g. the tracking UID of a
/// measurement group inside an SR.
pub(crate) fn child_uid(parent: &str, name: &str) -> String {
    derive_uid(&[parent, name])
}

/// Whether `uid` is a valid UID (PS3.5 9.1): at most 64 characters, components of digits
/// separated by single dots, no component empty or with a leading zero (other than `0` itself).
pub fn is_valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 64
        && uid.split('.').all(|c| {
            !c.is_empty()
                && c.bytes().all(|b| b.is_ascii_digit())
                && (c == "0" || !c.starts_with('0'))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Vec<ModelInfo> {
        vec![
            ModelInfo {
                id: "densenet121-res224-all".into(),
                sha256: "a".repeat(64),
            },
            ModelInfo {
                id: "lung-unet".into(),
                sha256: "b".repeat(64),
            },
        ]
    }

    fn uids(
        study: &str,
        image: &str,
        protocol: &str,
        kind: ObjectKind,
        models: &[ModelInfo],
    ) -> ResultUids {
        ResultUids::derive(study, image, protocol, kind, models)
    }

    #[test]
    fn same_inputs_give_the_same_uids() {
        let a = uids("1.2.3", "1.2.3.4", "cxr-pa", ObjectKind::Sr, &models());
        let b = uids("1.2.3", "1.2.3.4", "cxr-pa", ObjectKind::Sr, &models());
        assert_eq!(a, b);
        let mut reversed = models();
        reversed.reverse();
        assert_eq!(
            a,
            uids("1.2.3", "1.2.3.4", "cxr-pa", ObjectKind::Sr, &reversed)
        );
        assert_ne!(a.series_instance_uid, a.sop_instance_uid);
    }

    #[test]
    fn any_changed_input_changes_the_uids() {
        let base = uids("1.2.3", "1.2.3.4", "cxr-pa", ObjectKind::Sr, &models());
        let mut other_weights = models();
        other_weights[1].sha256 = "c".repeat(64);
        let mut other_id = models();
        other_id[0].id = "resnet50-res512-all".into();
        let changed = [
            uids("1.2.4", "1.2.3.4", "cxr-pa", ObjectKind::Sr, &models()),
            uids("1.2.3", "1.2.3.4", "cxr-lat", ObjectKind::Sr, &models()),
            uids("1.2.3", "1.2.3.4", "cxr-pa", ObjectKind::Seg, &models()),
            uids("1.2.3", "1.2.3.4", "cxr-pa", ObjectKind::Sc, &models()),
            uids("1.2.3", "1.2.3.4", "cxr-pa", ObjectKind::Sr, &other_weights),
            uids("1.2.3", "1.2.3.4", "cxr-pa", ObjectKind::Sr, &other_id),
            uids("1.2.3", "1.2.3.4", "cxr-pa", ObjectKind::Sr, &models()[..1]),
        ];
        for c in &changed {
            assert_ne!(c.series_instance_uid, base.series_instance_uid);
            assert_ne!(c.sop_instance_uid, base.sop_instance_uid);
        }
        // Another image of the same study: same series, another instance.
        let lateral = uids("1.2.3", "1.2.3.5", "cxr-pa", ObjectKind::Sr, &models());
        assert_eq!(lateral.series_instance_uid, base.series_instance_uid);
        assert_ne!(lateral.sop_instance_uid, base.sop_instance_uid);
        // Length prefixes: moving a character between fields changes the digest.
        assert_ne!(derive_uid(&["ab", "c"]), derive_uid(&["a", "bc"]));
    }

    #[test]
    fn derived_uids_are_valid() {
        for i in 0..2000 {
            let s = i.to_string();
            let u = derive_uid(&[&s]);
            assert!(is_valid_uid(&u), "{u}");
            assert!(u.starts_with("2.25."), "{u}");
        }
    }

    #[test]
    fn uid_syntax_is_checked() {
        assert!(is_valid_uid("1.2.840.10008.5.1.4.1.1.66.4"));
        assert!(is_valid_uid("2.25.0"));
        assert!(!is_valid_uid("2.25.01"));
        assert!(!is_valid_uid("1..2"));
        assert!(!is_valid_uid("1.2."));
        assert!(!is_valid_uid("1.2a"));
        assert!(!is_valid_uid(&format!("1.{}", "2".repeat(63))));
    }
}
