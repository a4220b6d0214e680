//! One association: negotiation through dicom-ul, then the DIMSE messages it carries (C-ECHO,
//! C-STORE) until release or abort.

use std::net::{SocketAddr, TcpStream};

use dicom_core::{dicom_value, DataElement, VR};
use dicom_dictionary_std::tags;
use dicom_object::InMemDicomObject;
use dicom_transfer_syntax_registry::entries::IMPLICIT_VR_LITTLE_ENDIAN;
use dicom_ul::association::server::AccessControl;
use dicom_ul::association::{Association, Error as UlError};
use dicom_ul::pdu::{
    AssociationRJServiceUserReason, PDataValue, PDataValueType, Pdu,
    PresentationContextResultReason, UserIdentity,
};
use dicom_ul::{ServerAssociation, ServerAssociationOptions};
use tracing::{debug, info, warn};

use super::store::{self, Outcome};
use super::{Shared, STORAGE_SOP_CLASSES, VERIFICATION_SOP_CLASS};

/// The largest P-DATA PDU the node accepts (its A-ASSOCIATE-AC's maximum length).
const MAX_PDU_LENGTH: u32 = 64 * 1024;
/// A command set is a few hundred bytes; more than this is not a command.
const MAX_COMMAND_BYTES: usize = 64 * 1024;

const C_STORE_RQ: u16 = 0x0001;
const C_STORE_RSP: u16 = 0x8001;
const C_ECHO_RQ: u16 = 0x0030;
const C_ECHO_RSP: u16 = 0x8030;
const C_CANCEL_RQ: u16 = 0x0FFF;
/// CommandDataSetType: no data set follows.
const NO_DATA_SET: u16 = 0x0101;

/// Checks the calling and called AE titles during negotiation.
struct Titles<'a> {
    allowed_callers: &'a [String],
    peer: SocketAddr,
}

impl AccessControl for Titles<'_> {
    fn check_access(
        &self,
        this_ae_title: &str,
        calling_ae_title: &str,
        called_ae_title: &str,
        _user_identity: Option<&UserIdentity>,
    ) -> Result<(), AssociationRJServiceUserReason> {
        let calling = calling_ae_title.trim();
        let called = called_ae_title.trim();
        if !self.allowed_callers.is_empty()
            && !self.allowed_callers.iter().any(|a| a.trim() == calling)
        {
            warn!(
                target: "hilum_pacs::scp",
                peer = %self.peer,
                calling_ae = calling,
                "association rejected: calling AE title not allowed (A-ASSOCIATE-RJ permanent, \
                 calling AE title not recognized)"
            );
            return Err(AssociationRJServiceUserReason::CallingAETitleNotRecognized);
        }
        if called != this_ae_title.trim() {
            warn!(
                target: "hilum_pacs::scp",
                peer = %self.peer,
                calling_ae = calling,
                called_ae = called,
                "association rejected: called AE title is not this node's (A-ASSOCIATE-RJ \
                 permanent, called AE title not recognized)"
            );
            return Err(AssociationRJServiceUserReason::CalledAETitleNotRecognized);
        }
        Ok(())
    }
}

/// Negotiates and serves one association; everything that goes wrong is logged here.
pub(super) fn serve(shared: &Shared, stream: TcpStream, peer: SocketAddr) {
    let cfg = &shared.cfg;
    let titles = Titles {
        allowed_callers: &cfg.allowed_callers,
        peer,
    };
    let mut options = ServerAssociationOptions::new()
        .ae_access_control(titles)
        .ae_title(cfg.ae_title.trim())
        .max_pdu_length(MAX_PDU_LENGTH)
        .read_timeout(cfg.timeout)
        .write_timeout(cfg.timeout)
        .with_abstract_syntax(VERIFICATION_SOP_CLASS);
    for (uid, _) in STORAGE_SOP_CLASSES {
        options = options.with_abstract_syntax(*uid);
    }
    for ts in store::readable_transfer_syntaxes() {
        options = options.with_transfer_syntax(ts);
    }
    let mut association = match options.establish(stream) {
        Ok(a) => a,
        Err(UlError::Rejected { .. }) => return, // logged by the access control
        Err(e) => {
            warn!(target: "hilum_pacs::scp", peer = %peer, error = %e, "association not established");
            return;
        }
    };
    let calling_ae = association.peer_ae_title().trim().to_string();
    let accepted = association
        .presentation_contexts()
        .iter()
        .filter(|pc| pc.reason == PresentationContextResultReason::Acceptance)
        .count();
    info!(
        target: "hilum_pacs::scp",
        peer = %peer,
        calling_ae = %calling_ae,
        presentation_contexts = association.presentation_contexts().len(),
        accepted,
        "association accepted"
    );
    let mut state = State::default();
    loop {
        let pdu = match association.receive() {
            Ok(pdu) => pdu,
            Err(e) => {
                warn!(target: "hilum_pacs::scp", peer = %peer, calling_ae = %calling_ae, error = %e, "association dropped");
                return;
            }
        };
        match pdu {
            Pdu::PData { data } => {
                for pdv in data {
                    if let Err(why) = state.take(shared, &mut association, pdv, &calling_ae) {
                        warn!(
                            target: "hilum_pacs::scp",
                            peer = %peer,
                            calling_ae = %calling_ae,
                            reason = why,
                            "association aborted"
                        );
                        let _ = association.abort();
                        return;
                    }
                }
            }
            Pdu::ReleaseRQ => {
                let _ = association.send(&Pdu::ReleaseRP);
                info!(target: "hilum_pacs::scp", peer = %peer, calling_ae = %calling_ae, "association released");
                return;
            }
            Pdu::AbortRQ { .. } => {
                info!(target: "hilum_pacs::scp", peer = %peer, calling_ae = %calling_ae, "association aborted by the peer");
                return;
            }
            other => {
                warn!(
                    target: "hilum_pacs::scp",
                    peer = %peer,
                    calling_ae = %calling_ae,
                    pdu = other.short_description().to_string(),
                    "unexpected PDU; association aborted"
                );
                let _ = association.abort();
                return;
            }
        }
    }
}

/// A C-STORE whose data set is arriving.
struct PendingStore {
    message_id: u16,
    context_id: u8,
    sop_class_uid: String,
    sop_instance_uid: String,
    data: Vec<u8>,
    /// Bytes received so far (kept counting once past the limit, when `data` is dropped).
    received: u64,
    too_large: bool,
}

#[derive(Default)]
struct State {
    command: Vec<u8>,
    pending: Option<PendingStore>,
}

impl State {
    /// Takes one presentation data value. `Err`: the peer broke the protocol; abort.
    fn take(
        &mut self,
        shared: &Shared,
        association: &mut ServerAssociation<TcpStream>,
        pdv: PDataValue,
        calling_ae: &str,
    ) -> Result<(), &'static str> {
        match pdv.value_type {
            PDataValueType::Command => {
                if self.pending.is_some() {
                    return Err("a command arrived before the previous data set was complete");
                }
                if self.command.len() + pdv.data.len() > MAX_COMMAND_BYTES {
                    return Err("a command set larger than 64 KiB");
                }
                self.command.extend_from_slice(&pdv.data);
                if !pdv.is_last {
                    return Ok(());
                }
                let bytes = std::mem::take(&mut self.command);
                self.command_complete(association, pdv.presentation_context_id, &bytes)
            }
            PDataValueType::Data => {
                let max = shared.cfg.max_object_bytes;
                let Some(pending) = self.pending.as_mut() else {
                    return Err("a data set arrived without a C-STORE command");
                };
                if pending.context_id != pdv.presentation_context_id {
                    return Err(
                        "a data set arrived on another presentation context than its command",
                    );
                }
                pending.received = pending.received.saturating_add(pdv.data.len() as u64);
                if pending.received > max {
                    if !pending.too_large {
                        pending.too_large = true;
                        pending.data = Vec::new();
                    }
                } else {
                    pending.data.extend_from_slice(&pdv.data);
                }
                if !pdv.is_last {
                    return Ok(());
                }
                let Some(pending) = self.pending.take() else {
                    return Ok(());
                };
                store_complete(shared, association, pending, calling_ae)
            }
        }
    }

    fn command_complete(
        &mut self,
        association: &mut ServerAssociation<TcpStream>,
        context_id: u8,
        bytes: &[u8],
    ) -> Result<(), &'static str> {
        let ts = IMPLICIT_VR_LITTLE_ENDIAN.erased();
        let cmd = InMemDicomObject::read_dataset_with_ts(bytes, &ts)
            .map_err(|_| "a command set that is not implicit VR little endian DICOM")?;
        let field = cmd
            .get(tags::COMMAND_FIELD)
            .and_then(|e| e.to_int::<u16>().ok())
            .ok_or("a command without a Command Field")?;
        if field == C_CANCEL_RQ {
            return Ok(());
        }
        let message_id = cmd
            .get(tags::MESSAGE_ID)
            .and_then(|e| e.to_int::<u16>().ok())
            .ok_or("a command without a Message ID")?;
        let has_data = cmd
            .get(tags::COMMAND_DATA_SET_TYPE)
            .and_then(|e| e.to_int::<u16>().ok())
            .map(|t| t != NO_DATA_SET)
            .unwrap_or(false);
        let uid = |tag| {
            cmd.get(tag)
                .and_then(|e| e.to_str().ok())
                .map(|s| s.trim_end_matches(['\0', ' ']).to_string())
        };
        match field {
            C_ECHO_RQ => {
                let rsp = InMemDicomObject::command_from_element_iter([
                    DataElement::new(
                        tags::AFFECTED_SOP_CLASS_UID,
                        VR::UI,
                        dicom_value!(Str, VERIFICATION_SOP_CLASS),
                    ),
                    DataElement::new(tags::COMMAND_FIELD, VR::US, dicom_value!(U16, [C_ECHO_RSP])),
                    DataElement::new(
                        tags::MESSAGE_ID_BEING_RESPONDED_TO,
                        VR::US,
                        dicom_value!(U16, [message_id]),
                    ),
                    DataElement::new(
                        tags::COMMAND_DATA_SET_TYPE,
                        VR::US,
                        dicom_value!(U16, [NO_DATA_SET]),
                    ),
                    DataElement::new(
                        tags::STATUS,
                        VR::US,
                        dicom_value!(U16, [super::status::SUCCESS]),
                    ),
                ]);
                debug!(target: "hilum_pacs::scp", "C-ECHO answered");
                send_command(association, context_id, &rsp)
            }
            C_STORE_RQ => {
                if !has_data {
                    return Err("a C-STORE without a data set");
                }
                let sop_class_uid = uid(tags::AFFECTED_SOP_CLASS_UID)
                    .ok_or("a C-STORE without an Affected SOP Class UID")?;
                let sop_instance_uid = uid(tags::AFFECTED_SOP_INSTANCE_UID)
                    .ok_or("a C-STORE without an Affected SOP Instance UID")?;
                self.pending = Some(PendingStore {
                    message_id,
                    context_id,
                    sop_class_uid,
                    sop_instance_uid,
                    data: Vec::new(),
                    received: 0,
                    too_large: false,
                });
                Ok(())
            }
            _ => Err("a DIMSE command other than C-ECHO and C-STORE"),
        }
    }
}

/// Checks, stores and answers one complete C-STORE.
fn store_complete(
    shared: &Shared,
    association: &mut ServerAssociation<TcpStream>,
    pending: PendingStore,
    calling_ae: &str,
) -> Result<(), &'static str> {
    let transfer_syntax = association
        .presentation_contexts()
        .iter()
        .find(|pc| {
            pc.id == pending.context_id && pc.reason == PresentationContextResultReason::Acceptance
        })
        .map(|pc| pc.transfer_syntax.trim_end_matches(['\0', ' ']).to_string())
        .ok_or("a C-STORE on a presentation context that was not accepted")?;
    let outcome = if pending.too_large {
        Outcome::refused(
            super::status::OUT_OF_RESOURCES,
            "data set larger than the node's max_object_bytes",
        )
    } else {
        store::store(
            shared,
            &pending.data,
            &transfer_syntax,
            &pending.sop_class_uid,
            &pending.sop_instance_uid,
            calling_ae,
        )
    };
    if outcome.status == super::status::SUCCESS {
        info!(
            target: "hilum_pacs::scp",
            calling_ae,
            sop_instance_uid = %pending.sop_instance_uid,
            sop_class_uid = %pending.sop_class_uid,
            transfer_syntax = %transfer_syntax,
            bytes = pending.received,
            "C-STORE stored"
        );
    } else {
        warn!(
            target: "hilum_pacs::scp",
            calling_ae,
            sop_instance_uid = %pending.sop_instance_uid,
            sop_class_uid = %pending.sop_class_uid,
            transfer_syntax = %transfer_syntax,
            bytes = pending.received,
            status = format!("0x{:04X}", outcome.status),
            reason = outcome.comment,
            "C-STORE refused; nothing stored"
        );
    }
    let mut elements = vec![
        DataElement::new(
            tags::AFFECTED_SOP_CLASS_UID,
            VR::UI,
            dicom_value!(Str, pending.sop_class_uid.as_str()),
        ),
        DataElement::new(
            tags::COMMAND_FIELD,
            VR::US,
            dicom_value!(U16, [C_STORE_RSP]),
        ),
        DataElement::new(
            tags::MESSAGE_ID_BEING_RESPONDED_TO,
            VR::US,
            dicom_value!(U16, [pending.message_id]),
        ),
        DataElement::new(
            tags::COMMAND_DATA_SET_TYPE,
            VR::US,
            dicom_value!(U16, [NO_DATA_SET]),
        ),
        DataElement::new(tags::STATUS, VR::US, dicom_value!(U16, [outcome.status])),
        DataElement::new(
            tags::AFFECTED_SOP_INSTANCE_UID,
            VR::UI,
            dicom_value!(Str, pending.sop_instance_uid.as_str()),
        ),
    ];
    if outcome.status != super::status::SUCCESS {
        // Error Comment is LO: 64 characters at most.
        let comment: String = outcome.comment.chars().take(64).collect();
        elements.push(DataElement::new(
            tags::ERROR_COMMENT,
            VR::LO,
            dicom_value!(Str, comment),
        ));
    }
    let rsp = InMemDicomObject::command_from_element_iter(elements);
    send_command(association, pending.context_id, &rsp)
}

fn send_command(
    association: &mut ServerAssociation<TcpStream>,
    context_id: u8,
    cmd: &InMemDicomObject,
) -> Result<(), &'static str> {
    let ts = IMPLICIT_VR_LITTLE_ENDIAN.erased();
    let mut data = Vec::new();
    cmd.write_dataset_with_ts(&mut data, &ts)
        .map_err(|_| "cannot encode a response command")?;
    association
        .send(&Pdu::PData {
            data: vec![PDataValue {
                presentation_context_id: context_id,
                value_type: PDataValueType::Command,
                is_last: true,
                data,
            }],
        })
        .map_err(|_| "cannot send a response to the peer")
}
