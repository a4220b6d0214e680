//! The DICOM node (`hilum_pacs::scp`) against dcmtk's `echoscu` and `storescu` (Debian's
//! dcmtk, from `bash scripts/setup_pacs_tools.sh`), and against a small SCU built here from
//! dicom-ul for what storescu will not send (a truncated or non-DICOM data set).
//!
//! Each test starts its own node on 127.0.0.1, port 0, in this process. Without dcmtk the tests
//! that use it fail, naming the set-up script, unless HILUM_SKIP_PACS_TOOLS=1 says to skip them;
//! the tests with the Rust SCU always run. Every log line of the node goes to one buffer
//! (a global tracing subscriber), which the no-PHI test reads.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dicom_core::{dicom_value, DataElement, VR};
use dicom_dictionary_std::tags;
use dicom_object::{open_file, InMemDicomObject};
use dicom_transfer_syntax_registry::entries::IMPLICIT_VR_LITTLE_ENDIAN;
use dicom_ul::association::Error as UlError;
use dicom_ul::pdu::{
    AssociationRJResult, AssociationRJServiceProviderPresentationReason,
    AssociationRJServiceUserReason, AssociationRJSource, PDataValue, PDataValueType, Pdu,
    PresentationContextResultReason,
};
use dicom_ul::ClientAssociationOptions;
use hilum_pacs::read_dicom;
use hilum_pacs::scp::{status, Scp, ScpConfig, ShutdownHandle, StoredInstance};

use crate::common::{dicom_dir, CR_NO_META, MONO1, RG1, SIIM};

const AE: &str = "HILUM";
const CALLER: &str = "HILUMTEST";

// ---------------------------------------------------------------------------------------------
// Log capture

#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuf {
    type Writer = LogBuf;
    fn make_writer(&'a self) -> LogBuf {
        self.clone()
    }
}

/// Every log line of every crate, at every level, from the first node started on.
fn logs() -> &'static LogBuf {
    static LOGS: OnceLock<LogBuf> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = LogBuf::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(buf.clone())
            .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other test of this binary sets a global tracing subscriber");
        buf
    })
}

fn log_text() -> String {
    String::from_utf8_lossy(&logs().0.lock().unwrap()).into_owned()
}

// ---------------------------------------------------------------------------------------------
// The node

/// A scratch folder removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("hilum-pacs-scp-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Node {
    addr: SocketAddr,
    dir: Scratch,
    stored: mpsc::Receiver<StoredInstance>,
    handle: ShutdownHandle,
    thread: Option<JoinHandle<()>>,
}

impl Node {
    fn start(name: &str, tweak: impl FnOnce(&mut ScpConfig)) -> Node {
        logs();
        let dir = Scratch::new(name);
        let mut cfg = ScpConfig::new(AE, dir.0.join("store"));
        cfg.timeout = Duration::from_secs(20);
        tweak(&mut cfg);
        let (tx, stored) = mpsc::channel();
        let tx = Mutex::new(tx);
        let scp = Scp::bind("127.0.0.1:0", cfg).unwrap().on_stored(move |i| {
            tx.lock()
                .unwrap()
                .send(i.clone())
                .map_err(|e| e.to_string())
        });
        let addr = scp.local_addr();
        let handle = scp.shutdown_handle();
        let thread = std::thread::spawn(move || scp.run().unwrap());
        Node {
            addr,
            dir,
            stored,
            handle,
            thread: Some(thread),
        }
    }

    fn store_dir(&self) -> PathBuf {
        self.dir.0.join("store")
    }

    /// Every file under the storage folder, temporary ones included.
    fn files(&self) -> Vec<PathBuf> {
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, out);
                } else {
                    out.push(p);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.store_dir(), &mut out);
        out.sort();
        out
    }

    fn port(&self) -> String {
        self.addr.port().to_string()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.handle.shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// dcmtk

/// Whether to run the dcmtk tests: true when echoscu and storescu run; false (said) when
/// HILUM_SKIP_PACS_TOOLS=1; a failure naming the set-up script otherwise.
fn dcmtk(test: &str) -> bool {
    if std::env::var("HILUM_SKIP_PACS_TOOLS").as_deref() == Ok("1") {
        eprintln!("{test}: skipped: HILUM_SKIP_PACS_TOOLS=1 (dcmtk's echoscu/storescu not run)");
        return false;
    }
    for tool in ["echoscu", "storescu"] {
        if let Err(e) = Command::new(tool).arg("--version").output() {
            panic!(
                "{test}: cannot run {tool} ({e}): run `eval \"$(bash scripts/setup_pacs_tools.sh)\"` \
                 (installs Debian's dcmtk), or set HILUM_SKIP_PACS_TOOLS=1 to skip the dcmtk tests"
            );
        }
    }
    true
}

fn run(tool: &str, args: &[&str]) -> Output {
    let out = Command::new(tool)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
    eprintln!(
        "$ {tool} {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// storescu's options to send one shared file: the transfer syntax to propose (the files are
/// sent as they are, storescu does not transcode compressed data), and for the file without a
/// File Meta header, to read it as a bare data set.
fn storescu_options(name: &str) -> Vec<&'static str> {
    match name {
        SIIM | MONO1 => vec!["-xy"], // JPEG baseline
        RG1 => vec!["-xw"],          // JPEG 2000 (lossy)
        CR_NO_META => vec!["-f"],    // bare implicit VR LE data set, no File Meta
        _ => vec![],
    }
}

fn storescu(node: &Node, calling: &str, name: &str) -> Output {
    let file = dicom_dir().join(name);
    let file = file.to_str().unwrap().to_string();
    let port = node.port();
    let mut args = vec!["-v", "-aet", calling, "-aec", AE];
    args.extend(storescu_options(name));
    args.extend(["127.0.0.1", port.as_str(), file.as_str()]);
    run("storescu", &args)
}

// ---------------------------------------------------------------------------------------------
// A small SCU on dicom-ul, for data sets storescu will not send

/// Sends `data` as the data set of one C-STORE and returns the response's Status (and Error
/// Comment), or the association error.
fn rust_store(
    addr: SocketAddr,
    calling: &str,
    sop_class: &str,
    sop_instance: &str,
    ts: &str,
    data: &[u8],
) -> Result<(u16, String), UlError> {
    let mut a = ClientAssociationOptions::new()
        .calling_ae_title(calling)
        .called_ae_title(AE)
        .with_presentation_context(sop_class, vec![ts])
        .establish(addr)?;
    let pc = a
        .presentation_contexts()
        .iter()
        .find(|pc| pc.reason == PresentationContextResultReason::Acceptance)
        .expect("the node accepts the storage presentation context")
        .clone();
    assert_eq!(pc.transfer_syntax, ts);
    let cmd = InMemDicomObject::command_from_element_iter([
        DataElement::new(
            tags::AFFECTED_SOP_CLASS_UID,
            VR::UI,
            dicom_value!(Str, sop_class),
        ),
        DataElement::new(tags::COMMAND_FIELD, VR::US, dicom_value!(U16, [0x0001])),
        DataElement::new(tags::MESSAGE_ID, VR::US, dicom_value!(U16, [7])),
        DataElement::new(tags::PRIORITY, VR::US, dicom_value!(U16, [0])),
        DataElement::new(
            tags::COMMAND_DATA_SET_TYPE,
            VR::US,
            dicom_value!(U16, [0x0000]),
        ),
        DataElement::new(
            tags::AFFECTED_SOP_INSTANCE_UID,
            VR::UI,
            dicom_value!(Str, sop_instance),
        ),
    ]);
    let mut bytes = Vec::new();
    cmd.write_dataset_with_ts(&mut bytes, &IMPLICIT_VR_LITTLE_ENDIAN.erased())
        .unwrap();
    a.send(&Pdu::PData {
        data: vec![PDataValue {
            presentation_context_id: pc.id,
            value_type: PDataValueType::Command,
            is_last: true,
            data: bytes,
        }],
    })?;
    {
        let mut w = a.send_pdata(pc.id);
        w.write_all(data).unwrap();
        w.finish().unwrap();
    }
    let rsp = match a.receive()? {
        Pdu::PData { data } => data
            .into_iter()
            .find(|v| v.value_type == PDataValueType::Command)
            .expect("a response command"),
        other => panic!("expected the C-STORE response, got {other:?}"),
    };
    let rsp =
        InMemDicomObject::read_dataset_with_ts(&rsp.data[..], &IMPLICIT_VR_LITTLE_ENDIAN.erased())
            .unwrap();
    let status = rsp.get(tags::STATUS).unwrap().to_int::<u16>().unwrap();
    let comment = rsp
        .get(tags::ERROR_COMMENT)
        .map(|e| e.to_str().unwrap().trim().to_string())
        .unwrap_or_default();
    assert_eq!(
        rsp.get(tags::MESSAGE_ID_BEING_RESPONDED_TO)
            .unwrap()
            .to_int::<u16>()
            .unwrap(),
        7
    );
    a.release()?;
    Ok((status, comment))
}

/// The data set of a shared file (File Meta stripped), its SOP class and instance and transfer
/// syntax, as dicom-object reads them.
fn dataset_of(name: &str) -> (Vec<u8>, String, String, String) {
    let bytes = std::fs::read(dicom_dir().join(name)).unwrap();
    let obj = read_dicom(&bytes).unwrap();
    let ts = obj.meta().transfer_syntax().to_string();
    let class = obj.meta().media_storage_sop_class_uid().to_string();
    let instance = obj.meta().media_storage_sop_instance_uid().to_string();
    (
        dataset_bytes(&bytes).to_vec(),
        class,
        instance,
        ts.trim_end_matches('\0').to_string(),
    )
}

/// The data set of a Part 10 file (after the preamble, `DICM` and the File Meta group, whose
/// length is (0002,0000)'s value), or the whole of a bare data set.
fn dataset_bytes(bytes: &[u8]) -> &[u8] {
    if bytes.len() > 144 && &bytes[128..132] == b"DICM" {
        let group_len = u32::from_le_bytes(bytes[140..144].try_into().unwrap()) as usize;
        &bytes[144 + group_len..]
    } else {
        bytes
    }
}

/// The pixel data as bytes: the fragments of encapsulated data, or the native value.
fn pixel_bytes(obj: &InMemDicomObject) -> Vec<Vec<u8>> {
    let e = obj.get(tags::PIXEL_DATA).expect("pixel data");
    match e.value().fragments() {
        Some(f) => f.to_vec(),
        None => vec![e.to_bytes().unwrap().into_owned()],
    }
}

fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn echoscu_gets_an_answer() {
    if !dcmtk("echoscu_gets_an_answer") {
        return;
    }
    let node = Node::start("echo", |_| {});
    let out = run(
        "echoscu",
        &["-aet", CALLER, "-aec", AE, "127.0.0.1", &node.port()],
    );
    assert!(out.status.success(), "echoscu failed:\n{}", text(&out));
}

#[test]
fn storescu_stores_every_shared_dicom_with_its_pixels_unchanged() {
    if !dcmtk("storescu_stores_every_shared_dicom_with_its_pixels_unchanged") {
        return;
    }
    let node = Node::start("store", |c| c.allowed_callers = vec![CALLER.into()]);
    let mut paths = Vec::new();
    for name in [SIIM, MONO1, RG1, CR_NO_META] {
        let out = storescu(&node, CALLER, name);
        assert!(out.status.success(), "storescu {name}:\n{}", text(&out));
        let inst = node
            .stored
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("{name}: no StoredInstance"));

        let source = read_dicom(&std::fs::read(dicom_dir().join(name)).unwrap()).unwrap();
        let uid = |o: &InMemDicomObject, t| {
            o.get(t)
                .unwrap()
                .to_str()
                .unwrap()
                .trim_end_matches('\0')
                .to_string()
        };
        assert_eq!(
            inst.sop_instance_uid,
            uid(&source, tags::SOP_INSTANCE_UID),
            "{name}"
        );
        assert_eq!(
            inst.sop_class_uid,
            uid(&source, tags::SOP_CLASS_UID),
            "{name}"
        );
        assert_eq!(
            inst.study_uid,
            uid(&source, tags::STUDY_INSTANCE_UID),
            "{name}"
        );
        assert_eq!(
            inst.series_uid,
            uid(&source, tags::SERIES_INSTANCE_UID),
            "{name}"
        );
        assert_eq!(inst.calling_ae, CALLER);
        assert!(
            inst.decodable,
            "{name}: {} should be decodable",
            inst.transfer_syntax
        );
        assert_eq!(
            inst.path,
            node.store_dir()
                .join(&inst.study_uid)
                .join(format!("{}.dcm", inst.sop_instance_uid))
        );

        paths.push(inst.path.clone());
        let stored = open_file(&inst.path).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            stored.meta().transfer_syntax().trim_end_matches('\0'),
            inst.transfer_syntax
        );
        assert_eq!(
            stored
                .meta()
                .media_storage_sop_instance_uid()
                .trim_end_matches('\0'),
            inst.sop_instance_uid
        );
        if name != CR_NO_META {
            // Compressed files travel as they are: same transfer syntax. (storescu re-encodes
            // the rest of the data set, so only the pixel data is compared; the Rust SCU's test
            // below checks that the node keeps a data set byte for byte.)
            assert_eq!(
                inst.transfer_syntax,
                source.meta().transfer_syntax().trim_end_matches('\0'),
                "{name}"
            );
        }
        assert_eq!(
            pixel_bytes(&stored),
            pixel_bytes(&source),
            "{name}: stored pixel data bytes differ from the source's"
        );
    }
    // Only the final files, no temporary file left behind. The MONOCHROME1 variant has the
    // SIIM image's SOP Instance UID: it replaced it (a resend replaces, never duplicates).
    let mut expected = paths;
    expected.sort();
    expected.dedup();
    assert_eq!(expected.len(), 3);
    assert_eq!(node.files(), expected);
}

#[test]
fn an_unknown_calling_ae_title_is_rejected() {
    let node = Node::start("wrong-ae", |c| c.allowed_callers = vec![CALLER.into()]);
    // dicom-ul's client sees the A-ASSOCIATE-RJ and its reason.
    let (data, class, instance, ts) = dataset_of(SIIM);
    match rust_store(node.addr, "WRONG", &class, &instance, &ts, &data) {
        Err(UlError::Rejected { association_rj, .. }) => {
            assert_eq!(association_rj.result, AssociationRJResult::Permanent);
            assert_eq!(
                association_rj.source,
                AssociationRJSource::ServiceUser(
                    AssociationRJServiceUserReason::CallingAETitleNotRecognized
                )
            );
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    // Another called AE title: rejected too.
    let called_wrong = ClientAssociationOptions::new()
        .calling_ae_title(CALLER)
        .called_ae_title("NOTHILUM")
        .with_abstract_syntax("1.2.840.10008.1.1")
        .establish(node.addr);
    match called_wrong {
        Err(UlError::Rejected { association_rj, .. }) => assert_eq!(
            association_rj.source,
            AssociationRJSource::ServiceUser(
                AssociationRJServiceUserReason::CalledAETitleNotRecognized
            )
        ),
        other => panic!("expected a rejection, got {other:?}"),
    }
    if dcmtk("an_unknown_calling_ae_title_is_rejected") {
        let out = run(
            "echoscu",
            &["-aet", "WRONG", "-aec", AE, "127.0.0.1", &node.port()],
        );
        assert!(!out.status.success(), "echoscu -aet WRONG succeeded");
        assert!(
            text(&out).contains("Calling AE Title Not Recognized"),
            "{}",
            text(&out)
        );
        let out = storescu(&node, "WRONG", SIIM);
        assert!(!out.status.success(), "storescu -aet WRONG succeeded");
        let out = run(
            "echoscu",
            &["-aet", CALLER, "-aec", AE, "127.0.0.1", &node.port()],
        );
        assert!(out.status.success(), "the allowed caller: {}", text(&out));
    }
    assert!(node.files().is_empty(), "{:?}", node.files());
    assert!(node.stored.try_recv().is_err());
}

#[test]
fn a_host_not_allowed_is_rejected() {
    let node = Node::start("host", |c| {
        c.allowed_hosts = vec!["192.0.2.7".parse().unwrap()]
    });
    let r = ClientAssociationOptions::new()
        .calling_ae_title(CALLER)
        .called_ae_title(AE)
        .with_abstract_syntax("1.2.840.10008.1.1")
        .establish(node.addr);
    match r {
        Err(UlError::Rejected { association_rj, .. }) => {
            assert_eq!(association_rj.result, AssociationRJResult::Permanent);
            assert_eq!(
                association_rj.source,
                AssociationRJSource::ServiceUser(AssociationRJServiceUserReason::NoReasonGiven)
            );
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    let allowed = Node::start("host-ok", |c| {
        c.allowed_hosts = vec!["127.0.0.1".parse().unwrap()]
    });
    let a = ClientAssociationOptions::new()
        .calling_ae_title(CALLER)
        .called_ae_title(AE)
        .with_abstract_syntax("1.2.840.10008.1.1")
        .establish(allowed.addr)
        .expect("127.0.0.1 is allowed");
    a.release().unwrap();
}

#[test]
fn associations_beyond_the_limit_are_rejected_until_one_ends() {
    let node = Node::start("limit", |c| c.max_associations = 1);
    let open = || {
        ClientAssociationOptions::new()
            .calling_ae_title(CALLER)
            .called_ae_title(AE)
            .with_abstract_syntax("1.2.840.10008.1.1")
            .establish(node.addr)
    };
    let first = open().expect("the first association");
    match open() {
        Err(UlError::Rejected { association_rj, .. }) => {
            assert_eq!(association_rj.result, AssociationRJResult::Transient);
            assert_eq!(
                association_rj.source,
                AssociationRJSource::ServiceProviderPresentation(
                    AssociationRJServiceProviderPresentationReason::LocalLimitExceeded
                )
            );
        }
        other => panic!("expected a transient rejection, got {other:?}"),
    }
    first.release().unwrap();
    // The slot comes back when the first association's thread ends.
    let again = wait_for("a free association slot", || open().ok());
    again.release().unwrap();
}

#[test]
fn an_oversized_object_is_refused_and_nothing_is_stored() {
    let node = Node::start("oversized", |c| c.max_object_bytes = 100_000);
    let (data, class, instance, ts) = dataset_of(SIIM);
    assert!(data.len() > 100_000);
    let (status, comment) = rust_store(node.addr, CALLER, &class, &instance, &ts, &data).unwrap();
    assert_eq!(status, status::OUT_OF_RESOURCES, "{comment}");
    assert!(comment.contains("max_object_bytes"), "{comment}");
    if dcmtk("an_oversized_object_is_refused_and_nothing_is_stored") {
        let out = storescu(&node, CALLER, SIIM);
        let t = text(&out);
        assert!(t.contains("Refused: OutOfResources"), "{t}");
    }
    assert!(node.files().is_empty(), "{:?}", node.files());
    assert!(node.stored.try_recv().is_err());
}

#[test]
fn a_truncated_or_non_dicom_object_gets_a_failure_and_nothing_is_stored() {
    let node = Node::start("bad", |_| {});
    let (data, class, instance, ts) = dataset_of(CR_NO_META);
    assert_eq!(ts, "1.2.840.10008.1.2");
    // Cut in the middle of the pixel data.
    let truncated = &data[..data.len() - 1001];
    let (status, comment) =
        rust_store(node.addr, CALLER, &class, &instance, &ts, truncated).unwrap();
    assert_eq!(status, status::CANNOT_UNDERSTAND, "{comment}");
    // Not DICOM at all.
    let junk: Vec<u8> = b"This is a text file, not a DICOM data set. "
        .iter()
        .copied()
        .cycle()
        .take(5000)
        .collect();
    let (status, comment) = rust_store(node.addr, CALLER, &class, &instance, &ts, &junk).unwrap();
    assert_eq!(status & 0xF000, 0xC000, "0x{status:04X} {comment}");
    // A data set whose SOP instance is not the one announced.
    let (status, _) = rust_store(node.addr, CALLER, &class, "1.2.3.4.5", &ts, &data).unwrap();
    assert_eq!(status, status::INSTANCE_MISMATCH);
    assert!(node.files().is_empty(), "{:?}", node.files());
    assert!(node.stored.try_recv().is_err());
    // The whole one is stored, in the transfer syntax it came in.
    let (status, comment) = rust_store(node.addr, CALLER, &class, &instance, &ts, &data).unwrap();
    assert_eq!(status, status::SUCCESS, "{comment}");
    let inst = node.stored.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(inst.transfer_syntax, ts);
    assert_eq!(node.files(), vec![inst.path.clone()]);
    // The data set is kept byte for byte.
    let on_disk = std::fs::read(&inst.path).unwrap();
    assert!(on_disk.ends_with(&data));
}

#[test]
fn a_transfer_syntax_hilum_does_not_decode_is_stored_and_reported() {
    let node = Node::start("undecodable", |_| {});
    let (data, class, instance, _) = dataset_of(CR_NO_META);
    // Re-encode the bare implicit VR LE data set as explicit VR big endian (retired; dicom-rs
    // reads it, Hilum's imaging does not decode it).
    let obj =
        InMemDicomObject::read_dataset_with_ts(&data[..], &IMPLICIT_VR_LITTLE_ENDIAN.erased())
            .unwrap();
    let be = dicom_transfer_syntax_registry::entries::EXPLICIT_VR_BIG_ENDIAN.erased();
    let mut big = Vec::new();
    obj.write_dataset_with_ts(&mut big, &be).unwrap();
    let (status, comment) =
        rust_store(node.addr, CALLER, &class, &instance, be.uid(), &big).unwrap();
    assert_eq!(status, status::SUCCESS, "{comment}");
    let inst = node.stored.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(inst.transfer_syntax, be.uid());
    assert!(!inst.decodable);
    let stored = open_file(&inst.path).unwrap();
    assert_eq!(pixel_bytes(&stored), pixel_bytes(&obj));
    assert!(log_text().contains("does not decode"));
}

#[test]
fn no_patient_data_in_any_log_line() {
    let node = Node::start("phi", |c| c.allowed_callers = vec![CALLER.into()]);
    let mut phi: Vec<String> = Vec::new();
    for name in [SIIM, MONO1, RG1, CR_NO_META] {
        let obj = read_dicom(&std::fs::read(dicom_dir().join(name)).unwrap()).unwrap();
        for tag in [
            tags::PATIENT_NAME,
            tags::PATIENT_ID,
            tags::PATIENT_BIRTH_DATE,
        ] {
            if let Some(v) = obj.get(tag).and_then(|e| e.to_str().ok()) {
                let v = v.trim_end_matches(['\0', ' ']).trim().to_string();
                // Values too short to mean anything on their own (a one-digit id) would match
                // any log line; the shared files have none that short.
                if v.len() >= 3 {
                    phi.push(v);
                }
            }
        }
    }
    assert!(
        !phi.is_empty(),
        "the shared files have patient names/ids to look for"
    );
    // Every path a data set goes through: stored, refused (truncated, oversized), rejected.
    for name in [SIIM, MONO1, RG1, CR_NO_META] {
        let (data, class, instance, ts) = dataset_of(name);
        let (status, comment) =
            rust_store(node.addr, CALLER, &class, &instance, &ts, &data).unwrap();
        assert_eq!(status, status::SUCCESS, "{name}: {comment}");
        let inst = node.stored.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(
            dataset_bytes(&std::fs::read(&inst.path).unwrap()),
            &data[..],
            "{name}: the stored data set is not the one sent, byte for byte"
        );
        let (status, _) = rust_store(
            node.addr,
            CALLER,
            &class,
            &instance,
            &ts,
            &data[..data.len() / 2],
        )
        .unwrap();
        assert_ne!(
            status,
            status::SUCCESS,
            "{name}: half a data set was stored"
        );
    }
    if dcmtk("no_patient_data_in_any_log_line") {
        for name in [SIIM, MONO1, RG1, CR_NO_META] {
            let out = storescu(&node, CALLER, name);
            assert!(out.status.success(), "{}", text(&out));
        }
        let _ = storescu(&node, "WRONG", SIIM);
    }
    let small = Node::start("phi-small", |c| c.max_object_bytes = 1000);
    let (data, class, instance, ts) = dataset_of(SIIM);
    let (status, _) = rust_store(small.addr, CALLER, &class, &instance, &ts, &data).unwrap();
    assert_eq!(status, status::OUT_OF_RESOURCES);

    let logs = log_text();
    assert!(
        logs.contains("C-STORE stored"),
        "the node logged nothing:\n{logs}"
    );
    for v in &phi {
        for line in logs.lines() {
            assert!(
                !line.contains(v.as_str()),
                "a log line carries patient data {v:?}: {line}"
            );
        }
    }
}

#[test]
fn success_comes_after_the_file_is_whole_and_the_callback_took_it() {
    logs();
    let dir = Scratch::new("callback");
    let store = dir.0.join("store");
    let calls = Arc::new(Mutex::new(Vec::new()));
    let seen = calls.clone();
    let scp = Scp::bind("127.0.0.1:0", ScpConfig::new(AE, &store))
        .unwrap()
        .on_stored(move |i| {
            // When the callback runs, the file is complete under its final name and no
            // temporary file is left.
            let whole = open_file(&i.path).is_ok();
            let leftovers = std::fs::read_dir(i.path.parent().unwrap())
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
                .count();
            let mut calls = seen.lock().unwrap();
            calls.push((whole, leftovers));
            // The first is refused, as a job queue that cannot take it would.
            if calls.len() == 1 {
                Err("queue full".to_string())
            } else {
                Ok(())
            }
        });
    let addr = scp.local_addr();
    let handle = scp.shutdown_handle();
    let thread = std::thread::spawn(move || scp.run().unwrap());
    let (data, class, instance, ts) = dataset_of(RG1);
    let (status, comment) = rust_store(addr, CALLER, &class, &instance, &ts, &data).unwrap();
    assert_eq!(status, status::NOT_QUEUED, "{comment}");
    let (status, comment) = rust_store(addr, CALLER, &class, &instance, &ts, &data).unwrap();
    assert_eq!(status, status::SUCCESS, "{comment}");
    assert_eq!(*calls.lock().unwrap(), vec![(true, 0), (true, 0)]);
    handle.shutdown();
    thread.join().unwrap();
    assert!(
        !log_text().contains("queue full"),
        "the callback's text is not logged"
    );
}
