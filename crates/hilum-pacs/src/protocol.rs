//! Study protocols: which incoming studies Hilum runs on, and what it runs. A site configures
//! them as a table (`[[pacs.protocol]]` in the config file); each matches instances by modality,
//! body part, view position and series description, and gives a plan: a fixed list of tool
//! calls (no language model needed) and, optionally, a question for the agent. A study that
//! matches no protocol (a CT, an ultrasound) runs nothing, and [`NoMatch`] says why.

use serde::{Deserialize, Serialize};

use crate::source::SourceImage;

/// One protocol, as written in the config file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Protocol {
    /// Names the protocol in jobs, logs and result UIDs (`cxr-frontal`).
    pub name: String,
    /// Modalities (0008,0060) it takes; empty: any. Default: CR and DX.
    #[serde(default = "default_modalities")]
    pub modalities: Vec<String>,
    /// Body Part Examined (0018,0015) values it takes, e.g. `CHEST`; empty: any. An instance
    /// without the attribute matches only when `missing_body_part_ok` is true.
    #[serde(default)]
    pub body_parts: Vec<String>,
    /// Whether an instance without Body Part Examined matches `body_parts` (default: true).
    #[serde(default = "yes")]
    pub missing_body_part_ok: bool,
    /// View Position (0018,5101) values, e.g. `PA`, `AP`; empty: any (laterals included).
    #[serde(default)]
    pub view_positions: Vec<String>,
    /// Words the Series Description must contain (any of them, case-insensitive); empty: any.
    #[serde(default)]
    pub series_contains: Vec<String>,
    /// Tool calls run on each matching image, in this order; each takes the image as its only
    /// argument. Tools whose model is not installed are skipped and the job says so.
    #[serde(default = "default_tools")]
    pub tools: Vec<String>,
    /// A question for the agent, answered after the tools; its answer goes into the SR.
    #[serde(default)]
    pub question: Option<String>,
}

fn default_modalities() -> Vec<String> {
    vec!["CR".into(), "DX".into()]
}

fn default_tools() -> Vec<String> {
    ["classify_chest_xray", "segment_lungs", "measure_chest"]
        .map(String::from)
        .to_vec()
}

fn yes() -> bool {
    true
}

/// What a protocol is matched against: the attributes of one instance.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct InstanceFacts {
    /// Modality (0008,0060).
    pub modality: Option<String>,
    /// Body Part Examined (0018,0015).
    pub body_part: Option<String>,
    /// View Position (0018,5101).
    pub view_position: Option<String>,
    /// Series Description (0008,103E).
    pub series_description: Option<String>,
}

impl InstanceFacts {
    /// The facts of `source`, with the series description read beside it.
    pub fn of(source: &SourceImage, series_description: Option<String>) -> Self {
        InstanceFacts {
            modality: source.modality.clone(),
            body_part: source.body_part_examined.clone(),
            view_position: source.view_position.clone(),
            series_description,
        }
    }
}

/// Reads a Part 10 file (or a bare data set) into its source attributes and the facts protocols
/// match against (the series description included).
pub fn read_facts(bytes: &[u8]) -> crate::error::Result<(SourceImage, InstanceFacts)> {
    let obj = crate::source::read_dicom(bytes)?;
    let source = SourceImage::from_object(&obj)?;
    let description = crate::source::text(&obj, dicom_dictionary_std::tags::SERIES_DESCRIPTION);
    let facts = InstanceFacts::of(&source, description);
    Ok((source, facts))
}

/// Why an instance matched no protocol, one reason per protocol.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NoMatch {
    /// Why each protocol did not match, one per protocol; empty when none is configured.
    pub reasons: Vec<String>,
}

impl std::fmt::Display for NoMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.reasons.is_empty() {
            write!(
                f,
                "no protocol is configured ([[pacs.protocol]] in the config file)"
            )
        } else {
            write!(f, "matches no protocol: {}", self.reasons.join("; "))
        }
    }
}

fn listed(values: &[String], value: Option<&str>) -> bool {
    values.is_empty()
        || value.is_some_and(|v| {
            values
                .iter()
                .any(|x| x.trim().eq_ignore_ascii_case(v.trim()))
        })
}

impl Protocol {
    /// The default: `cxr`, CR and DX of any body part and view, the classifier, the lung
    /// segmentation and the chest measurements (where installed), no question.
    pub fn default_cxr() -> Protocol {
        Protocol {
            name: "cxr".into(),
            modalities: default_modalities(),
            body_parts: Vec::new(),
            missing_body_part_ok: true,
            view_positions: Vec::new(),
            series_contains: Vec::new(),
            tools: default_tools(),
            question: None,
        }
    }

    /// `None` when the instance matches, else why not (in words, without patient data).
    pub fn mismatch(&self, facts: &InstanceFacts) -> Option<String> {
        let shown = |v: &Option<String>| v.clone().unwrap_or_else(|| "(none)".into());
        if !listed(&self.modalities, facts.modality.as_deref()) {
            return Some(format!(
                "{}: modality {} is not one of {}",
                self.name,
                shown(&facts.modality),
                self.modalities.join(", ")
            ));
        }
        let body_ok = match &facts.body_part {
            None => self.missing_body_part_ok || self.body_parts.is_empty(),
            Some(_) => listed(&self.body_parts, facts.body_part.as_deref()),
        };
        if !body_ok {
            return Some(format!(
                "{}: body part {} is not one of {}",
                self.name,
                shown(&facts.body_part),
                self.body_parts.join(", ")
            ));
        }
        if !listed(&self.view_positions, facts.view_position.as_deref()) {
            return Some(format!(
                "{}: view {} is not one of {}",
                self.name,
                shown(&facts.view_position),
                self.view_positions.join(", ")
            ));
        }
        if !self.series_contains.is_empty() {
            let desc = facts
                .series_description
                .as_deref()
                .unwrap_or("")
                .to_lowercase();
            if !self
                .series_contains
                .iter()
                .any(|w| desc.contains(&w.to_lowercase()))
            {
                return Some(format!(
                    "{}: the series description has none of {}",
                    self.name,
                    self.series_contains.join(", ")
                ));
            }
        }
        None
    }
}

/// The first protocol that matches, in configuration order.
pub fn select<'a>(
    protocols: &'a [Protocol],
    facts: &InstanceFacts,
) -> Result<&'a Protocol, NoMatch> {
    let mut reasons = Vec::new();
    for p in protocols {
        match p.mismatch(facts) {
            None => return Ok(p),
            Some(why) => reasons.push(why),
        }
    }
    Err(NoMatch { reasons })
}

/// Checks a configured table: names present and unique, tools named.
pub fn validate(protocols: &[Protocol]) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for p in protocols {
        if p.name.trim().is_empty() {
            return Err("a [[pacs.protocol]] entry has no name".into());
        }
        if !seen.insert(p.name.as_str()) {
            return Err(format!(
                "two [[pacs.protocol]] entries are named `{}`",
                p.name
            ));
        }
        if p.tools.is_empty() && p.question.is_none() {
            return Err(format!(
                "protocol `{}` has neither tools nor a question: it would run nothing",
                p.name
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frontal() -> Protocol {
        Protocol {
            name: "cxr-frontal".into(),
            modalities: default_modalities(),
            body_parts: vec!["CHEST".into()],
            missing_body_part_ok: true,
            view_positions: vec!["PA".into(), "AP".into()],
            series_contains: vec![],
            tools: default_tools(),
            question: None,
        }
    }

    fn facts(modality: &str, body: Option<&str>, view: Option<&str>) -> InstanceFacts {
        InstanceFacts {
            modality: Some(modality.into()),
            body_part: body.map(String::from),
            view_position: view.map(String::from),
            series_description: None,
        }
    }

    #[test]
    fn a_frontal_chest_radiograph_matches_and_a_ct_says_why_not() {
        let table = vec![frontal()];
        assert!(select(&table, &facts("CR", Some("CHEST"), Some("PA"))).is_ok());
        assert!(select(&table, &facts("DX", None, Some("ap"))).is_ok());
        let ct = select(&table, &facts("CT", Some("CHEST"), None)).expect_err("no match");
        assert_eq!(
            ct.to_string(),
            "matches no protocol: cxr-frontal: modality CT is not one of CR, DX"
        );
        let lateral = select(&table, &facts("CR", Some("CHEST"), Some("LL"))).expect_err("no");
        assert!(lateral.to_string().contains("view LL is not one of PA, AP"));
        let knee = select(&table, &facts("CR", Some("KNEE"), Some("AP"))).expect_err("no");
        assert!(knee.to_string().contains("body part KNEE"));
        assert!(select(&[], &facts("CR", None, None))
            .expect_err("none")
            .to_string()
            .contains("no protocol is configured"));
    }

    #[test]
    fn the_table_reads_from_toml_with_defaults_and_rejects_typos() {
        #[derive(Deserialize)]
        struct File {
            protocol: Vec<Protocol>,
        }
        let f: File = toml_like(
            r#"{"protocol": [{"name": "cxr", "series_contains": ["chest"], "question": "Is the heart enlarged?"}]}"#,
        );
        let p = &f.protocol[0];
        assert_eq!(p.modalities, ["CR", "DX"]);
        assert_eq!(p.tools, default_tools());
        let mut with_desc = facts("CR", None, None);
        assert!(p.mismatch(&with_desc).is_some());
        with_desc.series_description = Some("Chest PA".into());
        assert!(p.mismatch(&with_desc).is_none());
        assert!(serde_json::from_str::<Protocol>(r#"{"name": "x", "modality": ["CR"]}"#).is_err());
        assert!(validate(&[p.clone(), p.clone()]).is_err());
        assert!(validate(&f.protocol).is_ok());
    }

    fn toml_like<T: serde::de::DeserializeOwned>(json: &str) -> T {
        serde_json::from_str(json).expect("parses")
    }
}
