//! One received data set: checked with dicom-object, written atomically as a Part 10 file,
//! handed to the `on_stored` callback.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use dicom_dictionary_std::tags;
use dicom_object::meta::FileMetaTableBuilder;
use dicom_object::InMemDicomObject;
use dicom_parser::dataset::{DataSetReader, DataToken};
use dicom_transfer_syntax_registry::TransferSyntaxIndex;
use dicom_transfer_syntax_registry::{TransferSyntax, TransferSyntaxRegistry};

use super::{status, Shared, StoredInstance, DECODABLE_TRANSFER_SYNTAXES};

/// The answer to one C-STORE: its status and, for a refusal, why (sent back as Error Comment
/// and logged; never an attribute value of the data set).
pub(super) struct Outcome {
    pub status: u16,
    pub comment: &'static str,
}

impl Outcome {
    pub fn refused(status: u16, comment: &'static str) -> Self {
        Self { status, comment }
    }
}

/// Every transfer syntax whose data sets dicom-rs reads: the node accepts them all (those it
/// cannot decode are stored and reported, not refused).
pub(super) fn readable_transfer_syntaxes() -> Vec<&'static str> {
    let mut all: Vec<&'static str> = TransferSyntaxRegistry
        .iter()
        .filter(|ts| !ts.is_unsupported())
        .map(|ts| ts.uid())
        .collect();
    // Proposals are matched in the peer's order; put Hilum's decodable ones first anyway, so the
    // list reads well in a debugger.
    all.sort_by_key(|uid| !DECODABLE_TRANSFER_SYNTAXES.contains(uid));
    all
}

/// A UID as PS3.5 9.1 has it: digits and dots, 64 characters at most, no empty component.
/// Also what makes it safe as a file or folder name.
fn valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && uid.split('.').all(|c| !c.is_empty())
}

fn uid_of(obj: &InMemDicomObject, tag: dicom_core::Tag) -> Option<String> {
    let s = obj.get(tag)?.to_str().ok()?;
    let s = s.trim_end_matches(['\0', ' ']).trim_start();
    valid_uid(s).then(|| s.to_string())
}

pub(super) fn store(
    shared: &Shared,
    data: &[u8],
    transfer_syntax: &str,
    command_sop_class: &str,
    command_sop_instance: &str,
    calling_ae: &str,
) -> Outcome {
    let Some(ts) = TransferSyntaxRegistry.get(transfer_syntax) else {
        return Outcome::refused(
            status::CANNOT_UNDERSTAND,
            "transfer syntax unknown to the node",
        );
    };
    if !complete(data, ts) {
        return Outcome::refused(
            status::CANNOT_UNDERSTAND,
            "data set cut short (truncated) or malformed",
        );
    }
    let obj = match InMemDicomObject::read_dataset_with_ts(data, ts) {
        Ok(obj) => obj,
        Err(_) => {
            return Outcome::refused(
                status::CANNOT_UNDERSTAND,
                "not a DICOM data set in the negotiated transfer syntax",
            )
        }
    };
    let (Some(sop_class_uid), Some(sop_instance_uid), Some(study_uid), Some(series_uid)) = (
        uid_of(&obj, tags::SOP_CLASS_UID),
        uid_of(&obj, tags::SOP_INSTANCE_UID),
        uid_of(&obj, tags::STUDY_INSTANCE_UID),
        uid_of(&obj, tags::SERIES_INSTANCE_UID),
    ) else {
        return Outcome::refused(
            status::MISSING_UIDS,
            "SOP Class/Instance, Study or Series UID missing or invalid",
        );
    };
    if sop_class_uid != command_sop_class {
        return Outcome::refused(
            status::SOP_CLASS_MISMATCH,
            "data set SOP Class UID differs from the command's",
        );
    }
    if sop_instance_uid != command_sop_instance {
        return Outcome::refused(
            status::INSTANCE_MISMATCH,
            "data set SOP Instance UID differs from the command's",
        );
    }
    let study_dir = shared.cfg.storage_dir.join(&study_uid);
    let path = study_dir.join(format!("{sop_instance_uid}.dcm"));
    if write_part10(
        &study_dir,
        &path,
        &sop_class_uid,
        &sop_instance_uid,
        transfer_syntax,
        calling_ae,
        data,
    )
    .is_err()
    {
        return Outcome::refused(status::CANNOT_WRITE, "cannot write to the node's storage");
    }
    let decodable = DECODABLE_TRANSFER_SYNTAXES.contains(&transfer_syntax);
    if !decodable {
        tracing::warn!(
            target: "hilum_pacs::scp",
            sop_instance_uid = %sop_instance_uid,
            transfer_syntax,
            "stored in a transfer syntax Hilum does not decode: reported, not analysed"
        );
    }
    let instance = StoredInstance {
        path,
        study_uid,
        series_uid,
        sop_instance_uid,
        sop_class_uid,
        transfer_syntax: transfer_syntax.to_string(),
        decodable,
        calling_ae: calling_ae.to_string(),
    };
    if let Some(on_stored) = &shared.on_stored {
        // The callback's reason is its own text, which may say anything: it is not logged here
        // (the caller logs what it may).
        if on_stored(&instance).is_err() {
            tracing::warn!(
                target: "hilum_pacs::scp",
                sop_instance_uid = %instance.sop_instance_uid,
                "the on_stored callback refused the instance; the sender is told to send again"
            );
            return Outcome::refused(status::NOT_QUEUED, "stored but not queued: send again");
        }
    }
    Outcome {
        status: status::SUCCESS,
        comment: "",
    }
}

/// Whether the data set's tokens are all there: every value as long as its header says (the
/// parser copies a short fragment without complaint), every sequence closed (the parser takes
/// the end of the bytes inside encapsulated pixel data as the end of the object).
fn complete(data: &[u8], ts: &TransferSyntax) -> bool {
    let Ok(reader) = DataSetReader::new_with_ts(data, ts) else {
        return false;
    };
    let mut open_sequences: i64 = 0;
    let mut item_len: Option<u32> = None;
    for token in reader {
        match token {
            Err(_) => return false,
            Ok(DataToken::SequenceStart { .. }) | Ok(DataToken::PixelSequenceStart) => {
                open_sequences += 1
            }
            Ok(DataToken::SequenceEnd) => open_sequences -= 1,
            Ok(DataToken::ItemStart { len }) => item_len = len.get(),
            Ok(DataToken::ItemValue(v)) => {
                if item_len.map(u64::from) != Some(v.len() as u64) {
                    return false;
                }
            }
            Ok(DataToken::OffsetTable(t)) => {
                if item_len.map(u64::from) != Some(t.len() as u64 * 4) {
                    return false;
                }
            }
            Ok(_) => {}
        }
    }
    open_sequences == 0
}

/// Unique temporary names within this process (the pid makes them unique across processes).
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Preamble, `DICM`, the file meta group and the data set's bytes as received, through a
/// temporary file in the same folder: written, fsynced, renamed, the folder fsynced.
fn write_part10(
    study_dir: &Path,
    path: &Path,
    sop_class_uid: &str,
    sop_instance_uid: &str,
    transfer_syntax: &str,
    calling_ae: &str,
    data: &[u8],
) -> std::io::Result<()> {
    let io_err = |e: dicom_object::meta::Error| std::io::Error::other(e.to_string());
    let mut meta = FileMetaTableBuilder::new()
        .media_storage_sop_class_uid(sop_class_uid)
        .media_storage_sop_instance_uid(sop_instance_uid)
        .transfer_syntax(transfer_syntax);
    if !calling_ae.is_empty() {
        meta = meta.source_application_entity_title(calling_ae);
    }
    let meta = meta.build().map_err(io_err)?;
    let mut bytes = Vec::with_capacity(data.len() + 512);
    bytes.extend_from_slice(&[0u8; 128]);
    bytes.extend_from_slice(b"DICM");
    meta.write(&mut bytes).map_err(io_err)?;
    bytes.extend_from_slice(data);

    let new_dir = !study_dir.is_dir();
    std::fs::create_dir_all(study_dir)?;
    if new_dir {
        if let Some(parent) = study_dir.parent() {
            sync_dir(parent)?;
        }
    }
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp: PathBuf = study_dir.join(format!(
        ".{sop_instance_uid}.{}-{n}.tmp",
        std::process::id()
    ));
    let written = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        sync_dir(study_dir)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_that_are_safe_file_names() {
        assert!(valid_uid("1.2.840.10008.5.1.4.1.1.1"));
        assert!(!valid_uid(""));
        assert!(!valid_uid("1..2"));
        assert!(!valid_uid(".1.2"));
        assert!(!valid_uid("1.2."));
        assert!(!valid_uid("../etc"));
        assert!(!valid_uid("1.2/3"));
        assert!(!valid_uid(&"1.".repeat(40)));
    }

    #[test]
    fn every_decodable_transfer_syntax_is_accepted() {
        let all = readable_transfer_syntaxes();
        for ts in DECODABLE_TRANSFER_SYNTAXES {
            assert!(all.contains(ts), "{ts} is not readable by dicom-rs here");
        }
    }

    #[test]
    fn the_storage_classes_hilum_writes_and_reads_are_accepted() {
        let uids: Vec<&str> = super::super::STORAGE_SOP_CLASSES
            .iter()
            .map(|(u, _)| *u)
            .collect();
        for uid in [
            "1.2.840.10008.5.1.4.1.1.1",     // CR
            "1.2.840.10008.5.1.4.1.1.1.1",   // DX for presentation
            "1.2.840.10008.5.1.4.1.1.1.1.1", // DX for processing
            "1.2.840.10008.5.1.4.1.1.7",     // SC
            "1.2.840.10008.5.1.4.1.1.88.33", // Comprehensive SR
            "1.2.840.10008.5.1.4.1.1.88.22", // Enhanced SR
            "1.2.840.10008.5.1.4.1.1.66.4",  // SEG
            "1.2.840.10008.5.1.4.1.1.2",     // CT (stored; no protocol runs it)
        ] {
            assert!(uids.contains(&uid), "{uid}");
        }
        assert!(
            !uids.contains(&"1.2.840.10008.1.20.1"),
            "storage commitment is not storage"
        );
    }
}
