//! The Structured Report: a Comprehensive SR (PS3.3 A.35.3, SOP class
//! 1.2.840.10008.5.1.4.1.1.88.33) whose content follows PS3.16 TID 1500 "Measurement Report".
//!
//! Content tree (relationship, value type, concept):
//!
//! ```text
//! CONTAINER (126000, DCM, "Imaging Measurement Report")            TID 1500
//!   HAS CONCEPT MOD  CODE  Language of Content Item and Descendants = en-US        TID 1204
//!   HAS OBS CONTEXT  CODE  Observer Type = Device                                  TID 1002
//!   HAS OBS CONTEXT  UIDREF/TEXT  Device Observer UID, Name, Manufacturer,
//!                                 Model Name, Serial Number (Hilum and its version) TID 1004
//!   HAS CONCEPT MOD  CODE  Procedure reported = (399208008, SCT, "Plain chest X-ray")
//!   CONTAINS CONTAINER Image Library > Image Library Group > IMAGE Source (+ modality,
//!                                 pixel spacing descriptors)                        TID 1600
//!   CONTAINS CONTAINER Imaging Measurements
//!     CONTAINER Measurement Group "Chest measurements"                             TID 1501
//!       Tracking Identifier / UID; IMAGE Source of Measurement;
//!       NUM Area (42798000, SCT) per lung in mm2 (or {pixels}), Finding Site,     TID 300
//!           its own Tracking Identifier, Algorithm Name/Version (model id, sha256)  TID 4019
//!       NUM Cardiothoracic ratio (CTR, 99HILUM) in UCUM "1"
//!     CONTAINER Measurement Group per classifier finding                          TID 1501
//!       Tracking Identifier = label; CODE Finding = the label's concept;
//!       Algorithm Name/Version = model id, sha256; IMAGE Source of Measurement;
//!       NUM Probability (122157, DCM) in UCUM "1"
//!   CONTAINS CONTAINER Qualitative Evaluations (C0034375, UMLS)
//!     TEXT Agent question / Agent answer (99HILUM); TEXT Model "<id> sha256:<hex>" per
//!     model; TEXT Comment "For research use only. ..." when asked
//! ```
//!
//! highdicom (`MeasurementReport.get_image_measurement_groups`) reads every group back; the
//! source instance is also listed in CurrentRequestedProcedureEvidenceSequence (Hierarchical SOP
//! Instance Reference Macro), as the SR Document General module requires for referenced objects.

use dicom_core::value::PrimitiveValue;
use dicom_core::{DataElement, VR};
use dicom_dictionary_std::{tags, uids};
use dicom_object::{FileDicomObject, InMemDicomObject};

use crate::codes::{self, Code};
use crate::dataset::{self, put_code, put_seq, put_str, sop_ref};
use crate::error::{PacsError, Result};
use crate::result::{ResultSet, RESEARCH_ONLY_STATEMENT};
use crate::uid::{child_uid, derive_uid, ObjectKind, ResultUids};

/// Series Number of the SR series.
pub const SERIES_NUMBER: u32 = 9001;

#[derive(Clone, Copy)]
enum Rel {
    Contains,
    HasObsContext,
    HasConceptMod,
    HasAcqContext,
}

impl Rel {
    fn as_str(self) -> &'static str {
        match self {
            Rel::Contains => "CONTAINS",
            Rel::HasObsContext => "HAS OBS CONTEXT",
            Rel::HasConceptMod => "HAS CONCEPT MOD",
            Rel::HasAcqContext => "HAS ACQ CONTEXT",
        }
    }
}

/// A content item's common part: relationship, value type, concept name.
fn item(rel: Rel, value_type: &str, name: &Code) -> InMemDicomObject {
    let mut o = InMemDicomObject::new_empty();
    put_str(&mut o, tags::RELATIONSHIP_TYPE, VR::CS, rel.as_str());
    put_str(&mut o, tags::VALUE_TYPE, VR::CS, value_type);
    put_code(&mut o, tags::CONCEPT_NAME_CODE_SEQUENCE, name);
    o
}

fn with_children(mut o: InMemDicomObject, children: Vec<InMemDicomObject>) -> InMemDicomObject {
    if !children.is_empty() {
        put_seq(&mut o, tags::CONTENT_SEQUENCE, children);
    }
    o
}

fn text(rel: Rel, name: &Code, value: &str) -> InMemDicomObject {
    let mut o = item(rel, "TEXT", name);
    put_str(&mut o, tags::TEXT_VALUE, VR::UT, value);
    o
}

fn code(rel: Rel, name: &Code, value: &Code) -> InMemDicomObject {
    let mut o = item(rel, "CODE", name);
    put_code(&mut o, tags::CONCEPT_CODE_SEQUENCE, value);
    o
}

fn uidref(rel: Rel, name: &Code, uid: &str) -> InMemDicomObject {
    let mut o = item(rel, "UIDREF", name);
    put_str(&mut o, tags::UID, VR::UI, uid);
    o
}

/// A NUM item: the value as DS (at most 16 characters) and, exactly, as FD.
fn num(
    rel: Rel,
    name: &Code,
    value: f64,
    unit: &Code,
    children: Vec<InMemDicomObject>,
) -> InMemDicomObject {
    let mut o = item(rel, "NUM", name);
    let mut measured = InMemDicomObject::new_empty();
    put_str(
        &mut measured,
        tags::NUMERIC_VALUE,
        VR::DS,
        &dataset::ds(value),
    );
    measured.put(DataElement::new(
        tags::FLOATING_POINT_VALUE,
        VR::FD,
        PrimitiveValue::from(value),
    ));
    put_code(&mut measured, tags::MEASUREMENT_UNITS_CODE_SEQUENCE, unit);
    put_seq(&mut o, tags::MEASURED_VALUE_SEQUENCE, vec![measured]);
    with_children(o, children)
}

fn image(
    rel: Rel,
    name: &Code,
    class_uid: &str,
    instance_uid: &str,
    children: Vec<InMemDicomObject>,
) -> InMemDicomObject {
    let mut o = item(rel, "IMAGE", name);
    put_seq(
        &mut o,
        tags::REFERENCED_SOP_SEQUENCE,
        vec![sop_ref(class_uid, instance_uid)],
    );
    with_children(o, children)
}

fn container(
    rel: Rel,
    name: &Code,
    template: Option<&str>,
    children: Vec<InMemDicomObject>,
) -> InMemDicomObject {
    let mut o = item(rel, "CONTAINER", name);
    put_str(&mut o, tags::CONTINUITY_OF_CONTENT, VR::CS, "SEPARATE");
    if let Some(t) = template {
        put_seq(
            &mut o,
            tags::CONTENT_TEMPLATE_SEQUENCE,
            vec![template_item(t)],
        );
    }
    with_children(o, children)
}

fn template_item(id: &str) -> InMemDicomObject {
    let mut o = InMemDicomObject::new_empty();
    put_str(&mut o, tags::MAPPING_RESOURCE, VR::CS, "DCMR");
    put_str(&mut o, tags::TEMPLATE_IDENTIFIER, VR::CS, id);
    o
}

/// TID 4019 Algorithm Identification: the model's id and its weights' sha256.
fn algorithm(rs: &ResultSet, model_id: &str, what: &str) -> Result<Vec<InMemDicomObject>> {
    let model = rs.model(model_id, what)?;
    Ok(vec![
        text(Rel::HasConceptMod, &codes::algorithm_name(), &model.id),
        text(
            Rel::HasConceptMod,
            &codes::algorithm_version(),
            &model.sha256,
        ),
    ])
}

/// TID 4108 Tracking Identifier and Tracking Unique Identifier.
fn tracking(identifier: &str, uid: &str) -> Vec<InMemDicomObject> {
    vec![
        text(
            Rel::HasObsContext,
            &codes::tracking_identifier(),
            identifier,
        ),
        uidref(
            Rel::HasObsContext,
            &codes::tracking_unique_identifier(),
            uid,
        ),
    ]
}

fn source_of_measurement(rs: &ResultSet) -> InMemDicomObject {
    let name = Code::new("121112", "DCM", "Source of Measurement");
    image(
        Rel::Contains,
        &name,
        &rs.source.sop_class_uid,
        &rs.source.sop_instance_uid,
        Vec::new(),
    )
}

/// TID 1001/1002/1004: Hilum as the device observer.
fn observer_context(rs: &ResultSet) -> Vec<InMemDicomObject> {
    let d = &rs.device;
    let observer_uid = derive_uid(&[
        "device observer",
        &d.manufacturer,
        &d.model_name,
        &d.serial_number,
    ]);
    vec![
        code(
            Rel::HasObsContext,
            &codes::observer_type(),
            &codes::device(),
        ),
        uidref(
            Rel::HasObsContext,
            &codes::device_observer_uid(),
            &observer_uid,
        ),
        text(Rel::HasObsContext, &codes::device_observer_name(), &d.name),
        text(
            Rel::HasObsContext,
            &codes::device_observer_manufacturer(),
            &d.manufacturer,
        ),
        text(
            Rel::HasObsContext,
            &codes::device_observer_model_name(),
            &d.model_name,
        ),
        text(
            Rel::HasObsContext,
            &codes::device_observer_serial_number(),
            &d.serial_number,
        ),
    ]
}

/// TID 1600 Image Library: the source image with its modality and pixel spacing (TID 1602).
fn image_library(rs: &ResultSet) -> InMemDicomObject {
    let s = &rs.source;
    let mut descriptors = Vec::new();
    let modality = match s.modality.as_deref() {
        Some("CR") => Some("Computed Radiography"),
        Some("DX") => Some("Digital Radiography"),
        _ => None,
    };
    if let (Some(value), Some(meaning)) = (s.modality.as_deref(), modality) {
        descriptors.push(code(
            Rel::HasAcqContext,
            &Code::new("121139", "DCM", "Modality"),
            &Code::new(value, "DCM", meaning),
        ));
    }
    if let Some(spacing) = &s.pixel_spacing {
        let mm = Code::new("mm", "UCUM", "millimeter");
        descriptors.push(num(
            Rel::HasAcqContext,
            &Code::new("111026", "DCM", "Horizontal Pixel Spacing"),
            spacing.column_mm,
            &mm,
            Vec::new(),
        ));
        descriptors.push(num(
            Rel::HasAcqContext,
            &Code::new("111066", "DCM", "Vertical Pixel Spacing"),
            spacing.row_mm,
            &mm,
            Vec::new(),
        ));
    }
    let entry = image(
        Rel::Contains,
        &codes::source(),
        &s.sop_class_uid,
        &s.sop_instance_uid,
        descriptors,
    );
    let group = container(
        Rel::Contains,
        &codes::image_library_group(),
        None,
        vec![entry],
    );
    container(
        Rel::Contains,
        &codes::image_library(),
        Some("1600"),
        vec![group],
    )
}

/// The measurements group and one group per finding (TID 1501).
fn measurement_groups(rs: &ResultSet, instance_uid: &str) -> Result<Vec<InMemDicomObject>> {
    let mut groups = Vec::new();
    if !rs.measurements.is_empty() {
        let mut content = tracking(
            "Chest measurements",
            &child_uid(instance_uid, "group:measurements"),
        );
        content.push(source_of_measurement(rs));
        for (i, m) in rs.measurements.iter().enumerate() {
            let (value, unit) = m.resolved(rs.source.pixel_spacing.as_ref());
            let mut children = tracking(
                &m.name,
                &child_uid(instance_uid, &format!("measurement:{i}:{}", m.name)),
            );
            if let Some(site) = &m.site {
                children.push(code(Rel::HasConceptMod, &codes::finding_site(), site));
            }
            if let Some(model_id) = &m.model_id {
                children.extend(algorithm(
                    rs,
                    model_id,
                    &format!("measurement {:?}", m.name),
                )?);
            }
            content.push(num(Rel::Contains, &m.code, value, &unit, children));
        }
        groups.push(container(
            Rel::Contains,
            &codes::measurement_group(),
            Some("1501"),
            content,
        ));
    }
    for (i, f) in rs.findings.iter().enumerate() {
        let mut content = tracking(
            &f.label,
            &child_uid(instance_uid, &format!("finding:{i}:{}", f.label)),
        );
        content.push(code(Rel::Contains, &codes::finding(), &f.concept()));
        content.extend(algorithm(
            rs,
            &f.model_id,
            &format!("finding {:?}", f.label),
        )?);
        content.push(source_of_measurement(rs));
        content.push(num(
            Rel::Contains,
            &codes::probability(),
            f.probability,
            &codes::no_units(),
            Vec::new(),
        ));
        groups.push(container(
            Rel::Contains,
            &codes::measurement_group(),
            Some("1501"),
            content,
        ));
    }
    Ok(groups)
}

/// TID 1500 row 12: the question and answer, the models, the research statement.
fn qualitative_evaluations(rs: &ResultSet) -> Vec<InMemDicomObject> {
    let mut items = Vec::new();
    if let Some(q) = &rs.question {
        items.push(text(Rel::Contains, &codes::agent_question(), q));
    }
    if let Some(a) = &rs.answer {
        items.push(text(Rel::Contains, &codes::agent_answer(), a));
    }
    for m in &rs.models {
        items.push(text(
            Rel::Contains,
            &codes::model(),
            &format!("{} sha256:{}", m.id, m.sha256),
        ));
    }
    if rs.research_only {
        items.push(text(
            Rel::Contains,
            &codes::comment(),
            RESEARCH_ONLY_STATEMENT,
        ));
    }
    items
}

/// The SR's UIDs for this result set.
pub fn uids(rs: &ResultSet) -> ResultUids {
    ResultUids::derive(
        &rs.source.study.instance_uid,
        &rs.source.sop_instance_uid,
        &rs.protocol,
        ObjectKind::Sr,
        &rs.models,
    )
}

/// Writes the TID 1500 Comprehensive SR of `rs`. Fails when the result set is inconsistent
/// (a finding naming an unknown model, a probability outside 0..=1) or has nothing to report.
pub fn write(rs: &ResultSet) -> Result<FileDicomObject<InMemDicomObject>> {
    rs.validate()?;
    if rs.measurements.is_empty() && rs.findings.is_empty() && rs.answer.is_none() {
        return Err(PacsError::InvalidResult(
            "nothing to report: an SR needs at least one measurement, finding or answer".into(),
        ));
    }
    let ResultUids {
        series_instance_uid,
        sop_instance_uid,
    } = uids(rs);
    let class = uids::COMPREHENSIVE_SR_STORAGE;
    let mut o = InMemDicomObject::new_empty();
    dataset::sop_common(&mut o, class, &sop_instance_uid, &rs.created);
    dataset::declare_private_scheme(&mut o);
    dataset::patient_and_study(&mut o, rs);
    dataset::series(
        &mut o,
        "SR",
        &series_instance_uid,
        SERIES_NUMBER,
        &format!("Hilum report ({})", rs.protocol),
        &rs.created,
    );
    put_seq(
        &mut o,
        tags::REFERENCED_PERFORMED_PROCEDURE_STEP_SEQUENCE,
        Vec::new(),
    );
    dataset::equipment(&mut o, rs);

    // SR Document General (C.17.2).
    put_str(&mut o, tags::INSTANCE_NUMBER, VR::IS, "1");
    put_str(&mut o, tags::COMPLETION_FLAG, VR::CS, "COMPLETE");
    put_str(&mut o, tags::VERIFICATION_FLAG, VR::CS, "UNVERIFIED");
    put_str(&mut o, tags::CONTENT_DATE, VR::DA, &rs.created.date);
    put_str(&mut o, tags::CONTENT_TIME, VR::TM, &rs.created.time);
    put_seq(&mut o, tags::PERFORMED_PROCEDURE_CODE_SEQUENCE, Vec::new());
    put_seq(
        &mut o,
        tags::CURRENT_REQUESTED_PROCEDURE_EVIDENCE_SEQUENCE,
        vec![evidence(rs)],
    );

    // SR Document Content (C.17.3): the root container.
    put_str(&mut o, tags::VALUE_TYPE, VR::CS, "CONTAINER");
    put_code(
        &mut o,
        tags::CONCEPT_NAME_CODE_SEQUENCE,
        &codes::imaging_measurement_report(),
    );
    put_str(&mut o, tags::CONTINUITY_OF_CONTENT, VR::CS, "SEPARATE");
    put_seq(
        &mut o,
        tags::CONTENT_TEMPLATE_SEQUENCE,
        vec![template_item("1500")],
    );
    let mut content = vec![code(
        Rel::HasConceptMod,
        &codes::language_of_content(),
        &codes::english_us(),
    )];
    content.extend(observer_context(rs));
    content.push(code(
        Rel::HasConceptMod,
        &codes::procedure_reported(),
        &codes::plain_chest_xray(),
    ));
    content.push(image_library(rs));
    let groups = measurement_groups(rs, &sop_instance_uid)?;
    if !groups.is_empty() {
        content.push(container(
            Rel::Contains,
            &codes::imaging_measurements(),
            None,
            groups,
        ));
    }
    let evaluations = qualitative_evaluations(rs);
    if !evaluations.is_empty() {
        content.push(container(
            Rel::Contains,
            &codes::qualitative_evaluations(),
            None,
            evaluations,
        ));
    }
    put_seq(&mut o, tags::CONTENT_SEQUENCE, content);
    dataset::into_file(o, class, &sop_instance_uid)
}

/// Hierarchical SOP Instance Reference Macro (PS3.3 Table C.17-3): study > series > instance.
fn evidence(rs: &ResultSet) -> InMemDicomObject {
    let s = &rs.source;
    let mut series = InMemDicomObject::new_empty();
    put_str(
        &mut series,
        tags::SERIES_INSTANCE_UID,
        VR::UI,
        &s.series_instance_uid,
    );
    put_seq(
        &mut series,
        tags::REFERENCED_SOP_SEQUENCE,
        vec![sop_ref(&s.sop_class_uid, &s.sop_instance_uid)],
    );
    let mut study = InMemDicomObject::new_empty();
    put_str(
        &mut study,
        tags::STUDY_INSTANCE_UID,
        VR::UI,
        &s.study.instance_uid,
    );
    put_seq(&mut study, tags::REFERENCED_SERIES_SEQUENCE, vec![series]);
    study
}
