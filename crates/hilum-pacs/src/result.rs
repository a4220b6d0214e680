//! The results of one protocol run on one source image, as plain data: what the writers turn
//! into an SR, a SEG and a secondary-capture overlay.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::codes::{self, Code};
use crate::error::{PacsError, Result};
use crate::source::{PixelSpacing, SourceImage};
pub use crate::uid::ModelInfo;

/// The device that makes the results: written as General Equipment, Enhanced General Equipment
/// and as the SR's device observer (TID 1004).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    /// Manufacturer, written as the equipment's and the device observer's manufacturer.
    pub manufacturer: String,
    /// Device Observer Name in the SR.
    pub name: String,
    /// ManufacturerModelName, and Device Observer Model Name in the SR.
    pub model_name: String,
    /// SoftwareVersions (0018,1020).
    pub software_version: String,
    /// DeviceSerialNumber (Type 1 in Enhanced General Equipment): the site's installation id.
    pub serial_number: String,
}

impl Device {
    /// Hilum at `version`: manufacturer and name "Hilum", model name `Hilum <version>`.
    pub fn hilum(version: &str, serial_number: &str) -> Self {
        Self {
            manufacturer: "Hilum".into(),
            name: "Hilum".into(),
            model_name: format!("Hilum {version}"),
            software_version: version.into(),
            serial_number: serial_number.into(),
        }
    }
}

/// A DICOM date (`YYYYMMDD`) and time (`HHMMSS`), written as the objects' content and creation
/// times. Given by the caller so that a resend can reproduce an object byte for byte.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timestamp {
    /// `YYYYMMDD`.
    pub date: String,
    /// `HHMMSS`.
    pub time: String,
}

impl Timestamp {
    /// The current UTC time.
    pub fn now_utc() -> Self {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Self::from_unix_utc(secs)
    }

    /// The UTC date and time of `secs` since 1970-01-01T00:00:00Z.
    pub fn from_unix_utc(secs: u64) -> Self {
        let days = (secs / 86_400) as i64;
        let rem = secs % 86_400;
        // Civil date from days since the epoch (Howard Hinnant's days_from_civil inverse).
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        Self {
            date: format!("{year:04}{month:02}{day:02}"),
            time: format!("{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60),
        }
    }

    fn validate(&self) -> Result<()> {
        let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(&self.date, 8) || !digits(&self.time, 6) {
            return Err(PacsError::InvalidResult(format!(
                "created is {:?} {:?}: give the date as YYYYMMDD and the time as HHMMSS \
                 (Timestamp::now_utc())",
                self.date, self.time
            )));
        }
        Ok(())
    }
}

/// What a measurement measured, before units are settled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Quantity {
    /// An area counted in source pixels: written in mm² (UCUM `mm2`) when the source has a pixel
    /// spacing, else in pixels (UCUM `{pixels}`).
    AreaPixels(f64),
    /// A dimensionless ratio (UCUM `1`).
    Ratio(f64),
    /// A value already in the given UCUM unit.
    Value {
        /// The number.
        value: f64,
        /// Its UCUM unit.
        unit: Code,
    },
}

/// One numeric measurement (TID 300 inside the SR's TID 1501 measurement group).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// A human-readable name, written as the measurement's Tracking Identifier
    /// ("Right lung area").
    pub name: String,
    /// The concept measured, e.g. Area (42798000, SCT).
    pub code: Code,
    /// Where, e.g. Right lung (3341006, SCT), written as Finding Site.
    pub site: Option<Code>,
    /// What was measured and in which unit.
    pub quantity: Quantity,
    /// The model whose output this was computed from (one of the result set's models).
    pub model_id: Option<String>,
}

/// Left or right, as seen from the patient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Side {
    /// The patient's right.
    Right,
    /// The patient's left.
    Left,
}

impl Measurement {
    /// The area of one lung, from its mask's pixel count.
    pub fn lung_area(side: Side, pixels: u64, model_id: &str) -> Self {
        let (name, site) = match side {
            Side::Right => ("Right lung area", codes::right_lung()),
            Side::Left => ("Left lung area", codes::left_lung()),
        };
        Self {
            name: name.into(),
            code: codes::area(),
            site: Some(site),
            quantity: Quantity::AreaPixels(pixels as f64),
            model_id: Some(model_id.into()),
        }
    }

    /// The heart's area, from its mask's pixel count.
    pub fn heart_area(pixels: u64, model_id: &str) -> Self {
        Self {
            name: "Heart area".into(),
            code: codes::area(),
            site: Some(codes::heart()),
            quantity: Quantity::AreaPixels(pixels as f64),
            model_id: Some(model_id.into()),
        }
    }

    /// The cardiothoracic ratio (widest heart width over widest thoracic width).
    pub fn cardiothoracic_ratio(ratio: f64, model_id: &str) -> Self {
        Self {
            name: "Cardiothoracic ratio".into(),
            code: codes::cardiothoracic_ratio(),
            site: None,
            quantity: Quantity::Ratio(ratio),
            model_id: Some(model_id.into()),
        }
    }

    /// The value and unit as written: pixel areas become mm² when `spacing` is known.
    pub fn resolved(&self, spacing: Option<&PixelSpacing>) -> (f64, Code) {
        match &self.quantity {
            Quantity::AreaPixels(px) => match spacing {
                Some(s) => (px * s.pixel_area_mm2(), codes::mm2()),
                None => (*px, codes::pixels()),
            },
            Quantity::Ratio(r) => (*r, codes::no_units()),
            Quantity::Value { value, unit } => (*value, unit.clone()),
        }
    }

    fn raw_value(&self) -> f64 {
        match &self.quantity {
            Quantity::AreaPixels(v) | Quantity::Ratio(v) | Quantity::Value { value: v, .. } => *v,
        }
    }
}

/// One classifier output: a label, its probability, the model that gave it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// The classifier's label, e.g. `Cardiomegaly`.
    pub label: String,
    /// The concept; `None` takes [`codes::finding_code`] of the label.
    pub code: Option<Code>,
    /// The classifier's probability, in 0..=1.
    pub probability: f64,
    /// The model that gave it (one of the result set's models).
    pub model_id: String,
}

impl Finding {
    /// A finding coded by [`codes::finding_code`] of its label.
    pub fn new(label: &str, probability: f64, model_id: &str) -> Self {
        Self {
            label: label.into(),
            code: None,
            probability,
            model_id: model_id.into(),
        }
    }

    /// The concept written as the group's Finding.
    pub fn concept(&self) -> Code {
        self.code
            .clone()
            .unwrap_or_else(|| codes::finding_code(&self.label))
    }
}

/// One structure of the SEG: its coded category and type (CID 7150 / 7151) and its mask.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// Segment Label (0062,0005), e.g. `Right lung`.
    pub label: String,
    /// Segmented Property Category (CID 7150).
    pub category: Code,
    /// Segmented Property Type (CID 7151).
    pub property_type: Code,
    /// One value per source pixel, row-major, `rows * columns` long; non-zero is inside.
    pub mask: Vec<u8>,
    /// The model whose mask this is (one of the result set's models).
    pub model_id: String,
}

impl Segment {
    fn anatomy(label: &str, property_type: Code, mask: Vec<u8>, model_id: &str) -> Self {
        Self {
            label: label.into(),
            category: codes::anatomical_structure(),
            property_type,
            mask,
            model_id: model_id.into(),
        }
    }

    /// The right lung's mask.
    pub fn right_lung(mask: Vec<u8>, model_id: &str) -> Self {
        Self::anatomy("Right lung", codes::right_lung(), mask, model_id)
    }

    /// The left lung's mask.
    pub fn left_lung(mask: Vec<u8>, model_id: &str) -> Self {
        Self::anatomy("Left lung", codes::left_lung(), mask, model_id)
    }

    /// Both lungs as one structure (a model that does not separate sides).
    pub fn lungs(mask: Vec<u8>, model_id: &str) -> Self {
        Self::anatomy("Lung", codes::lung(), mask, model_id)
    }

    /// The heart's mask.
    pub fn heart(mask: Vec<u8>, model_id: &str) -> Self {
        Self::anatomy("Heart", codes::heart(), mask, model_id)
    }
}

/// An RGB overlay for the derived secondary-capture image: 8 bits per channel, interleaved
/// (R, G, B per pixel), row-major, annotations already drawn in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Overlay {
    /// Height in pixels.
    pub rows: u16,
    /// Width in pixels.
    pub columns: u16,
    /// `rows * columns * 3` bytes.
    pub rgb: Vec<u8>,
    /// What was drawn, written as DerivationDescription ("Lung masks and CTR lines by Hilum").
    pub description: String,
}

/// Everything one protocol run produced for one source image.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResultSet {
    /// The source image's attributes: its study and patient, and what the results refer to.
    pub source: SourceImage,
    /// The protocol's name: enters the UIDs and the series descriptions.
    pub protocol: String,
    /// The device written as equipment and observer.
    pub device: Device,
    /// Every model that contributed (id and weights' sha256): enters the UIDs, the SR's
    /// observer context and each group's algorithm identification.
    pub models: Vec<ModelInfo>,
    /// Numeric measurements, one SR measurement group each.
    pub measurements: Vec<Measurement>,
    /// Classifier outputs, one SR measurement group each.
    pub findings: Vec<Finding>,
    /// The question the protocol asked the agent, if any.
    pub question: Option<String>,
    /// The agent's answer, if any.
    pub answer: Option<String>,
    /// Structures for the SEG, one segment each.
    pub segments: Vec<Segment>,
    /// The annotated image for the secondary capture, if any.
    pub overlay: Option<Overlay>,
    /// Adds "research use only, not for diagnostic use" to every object (a model's licence
    /// may require it).
    pub research_only: bool,
    /// Content and creation date and time of every object.
    pub created: Timestamp,
}

/// The statement written where [`ResultSet::research_only`] asks for it, in the SR.
pub const RESEARCH_ONLY_STATEMENT: &str = concat!(
    "For research use only. Not for diagnostic use.",
    " Generated automatically by software; not reviewed by a physician."
);

/// Its first sentence, where a 64-character LO holds it (SEG ContentDescription, SC).
pub const RESEARCH_ONLY_SHORT: &str = "For research use only. Not for diagnostic use.";

impl ResultSet {
    /// A result set with no results yet, for `source`, made now.
    pub fn new(
        source: SourceImage,
        protocol: &str,
        device: Device,
        models: Vec<ModelInfo>,
    ) -> Self {
        Self {
            source,
            protocol: protocol.into(),
            device,
            models,
            measurements: Vec::new(),
            findings: Vec::new(),
            question: None,
            answer: None,
            segments: Vec::new(),
            overlay: None,
            research_only: false,
            created: Timestamp::now_utc(),
        }
    }

    pub(crate) fn model(&self, id: &str, what: &str) -> Result<&ModelInfo> {
        self.models.iter().find(|m| m.id == id).ok_or_else(|| {
            PacsError::InvalidResult(format!(
                "{what} names model {id:?}, which is not in ResultSet.models: add its ModelInfo \
                 (id and sha256), which the UIDs and the observer context need"
            ))
        })
    }

    /// Checks what every writer relies on; the message names the field to fix.
    pub(crate) fn validate(&self) -> Result<()> {
        self.created.validate()?;
        if self.protocol.trim().is_empty() {
            return Err(PacsError::InvalidResult(
                "protocol is empty: name the protocol that ran (it enters the UIDs)".into(),
            ));
        }
        for m in &self.models {
            if m.id.trim().is_empty() {
                return Err(PacsError::InvalidResult(
                    "a model has an empty id: give each ModelInfo its registry id".into(),
                ));
            }
            if m.sha256.len() != 64 || !m.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(PacsError::InvalidResult(format!(
                    "model {:?} has sha256 {:?}: give the 64 hex digits of its weights' SHA-256",
                    m.id, m.sha256
                )));
            }
        }
        for m in &self.measurements {
            if !m.raw_value().is_finite() {
                return Err(PacsError::InvalidResult(format!(
                    "measurement {:?} is not a finite number: leave it out instead",
                    m.name
                )));
            }
            if let Some(id) = &m.model_id {
                self.model(id, &format!("measurement {:?}", m.name))?;
            }
        }
        for f in &self.findings {
            if !(0.0..=1.0).contains(&f.probability) {
                return Err(PacsError::InvalidResult(format!(
                    "finding {:?} has probability {}: give a probability in 0..=1",
                    f.label, f.probability
                )));
            }
            self.model(&f.model_id, &format!("finding {:?}", f.label))?;
        }
        for s in &self.segments {
            self.model(&s.model_id, &format!("segment {:?}", s.label))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_time_becomes_dicom_date_and_time() {
        assert_eq!(
            Timestamp::from_unix_utc(0),
            Timestamp {
                date: "19700101".into(),
                time: "000000".into()
            }
        );
        // 2024-02-29T13:45:07Z, a leap day.
        let t = Timestamp::from_unix_utc(1_709_214_307);
        assert_eq!(
            (t.date.as_str(), t.time.as_str()),
            ("20240229", "13:45:07".replace(':', "").as_str())
        );
    }
}
