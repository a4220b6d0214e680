//! The DICOM node: a Storage SCP (C-STORE) that also answers C-ECHO, on dicom-rs's upper layer
//! (`dicom-ul`, its synchronous API, one std thread per association).
//!
//! [`Scp::bind`] opens the port, [`Scp::run`] accepts associations until
//! [`ShutdownHandle::shutdown`]. Each association is checked before anything is received:
//!
//! - a peer whose IP address is not in [`ScpConfig::allowed_hosts`] (when not empty) gets an
//!   A-ASSOCIATE-RJ (permanent, service user, no reason given);
//! - beyond [`ScpConfig::max_associations`] at once, an A-ASSOCIATE-RJ (transient, service
//!   provider presentation, local limit exceeded): the sender may try again later;
//! - a calling AE title not in [`ScpConfig::allowed_callers`] (when not empty): A-ASSOCIATE-RJ
//!   (permanent, calling AE title not recognized); a called AE title other than
//!   [`ScpConfig::ae_title`]: called AE title not recognized.
//!
//! Presentation contexts are accepted for Verification and every storage SOP class
//! ([`STORAGE_SOP_CLASSES`]), with every transfer syntax whose data set dicom-rs reads; those
//! Hilum's imaging crate also decodes are [`DECODABLE_TRANSFER_SYNTAXES`], the others are stored
//! all the same and reported ([`StoredInstance::decodable`] is false, and a log line says so).
//!
//! Each C-STORE's data set is read with dicom-object in the negotiated transfer syntax. It is
//! refused, and nothing is written, when it is larger than [`ScpConfig::max_object_bytes`]
//! ([`status::OUT_OF_RESOURCES`]), when it does not parse ([`status::CANNOT_UNDERSTAND`]), when
//! its identifying UIDs are missing or malformed ([`status::MISSING_UIDS`]) or differ from the
//! command's ([`status::SOP_CLASS_MISMATCH`], [`status::INSTANCE_MISMATCH`]). Otherwise it is
//! written as a Part 10 file, `<storage_dir>/<StudyInstanceUID>/<SOPInstanceUID>.dcm`, through a
//! temporary file that is fsynced and renamed (the folder fsynced too), so a file under its final
//! name is always whole. The data set's bytes are kept exactly as received. Only then is the
//! [`Scp::on_stored`] callback called and, when it returns `Ok`, the success status sent: an
//! instance is on disk, and wherever the callback put it, before the sender hears "stored".
//!
//! Logs (the `tracing` crate) carry AE titles, peer addresses, UIDs, SOP classes, transfer
//! syntaxes, sizes and statuses, never any other attribute of a data set: no patient's name,
//! id or birth date reaches a log line, nor any error text of dicom-rs's parser.

mod association;
mod storage_classes;
mod store;

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dicom_ul::pdu::{
    AssociationRJ, AssociationRJResult, AssociationRJServiceProviderPresentationReason,
    AssociationRJServiceUserReason, AssociationRJSource, Pdu,
};
use tracing::{info, warn};

pub use storage_classes::STORAGE_SOP_CLASSES;

/// The Verification SOP class (C-ECHO).
pub const VERIFICATION_SOP_CLASS: &str = "1.2.840.10008.1.1";

/// The transfer syntaxes whose pixel data hilum-imaging decodes: implicit and explicit VR
/// little endian, JPEG baseline, JPEG lossless (process 14 and its first-order prediction),
/// JPEG 2000 (lossless only and lossy) and RLE lossless. Instances in any other transfer syntax
/// the node accepts are stored and reported as not decodable.
pub const DECODABLE_TRANSFER_SYNTAXES: &[&str] = &[
    "1.2.840.10008.1.2",
    "1.2.840.10008.1.2.1",
    "1.2.840.10008.1.2.4.50",
    "1.2.840.10008.1.2.4.57",
    "1.2.840.10008.1.2.4.70",
    "1.2.840.10008.1.2.4.90",
    "1.2.840.10008.1.2.4.91",
    "1.2.840.10008.1.2.5",
];

/// The C-STORE response statuses the node sends (PS3.4 B.2.3; PS3.7 C.4.2 for 0x0000).
pub mod status {
    /// Stored (on disk, and accepted by the `on_stored` callback).
    pub const SUCCESS: u16 = 0x0000;
    /// Refused, out of resources: the data set is larger than `max_object_bytes`.
    pub const OUT_OF_RESOURCES: u16 = 0xA700;
    /// Refused, out of resources: the instance could not be written to the storage folder.
    pub const CANNOT_WRITE: u16 = 0xA701;
    /// Refused, out of resources: the `on_stored` callback refused the instance (the file is
    /// on disk; a resend replaces it).
    pub const NOT_QUEUED: u16 = 0xA702;
    /// Error, data set does not match SOP class: the data set's SOP Class UID differs from the
    /// command's Affected SOP Class UID.
    pub const SOP_CLASS_MISMATCH: u16 = 0xA900;
    /// Error, cannot understand: the bytes are not a DICOM data set in the negotiated transfer
    /// syntax (truncated, or not DICOM at all).
    pub const CANNOT_UNDERSTAND: u16 = 0xC000;
    /// Error, cannot understand: SOP Class, SOP Instance, Study or Series Instance UID missing
    /// or not a valid UID.
    pub const MISSING_UIDS: u16 = 0xC001;
    /// Error, cannot understand: the data set's SOP Instance UID differs from the command's
    /// Affected SOP Instance UID.
    pub const INSTANCE_MISMATCH: u16 = 0xC002;
}

/// The node's settings.
#[derive(Debug, Clone)]
pub struct ScpConfig {
    /// This node's AE title; associations calling another title are rejected.
    pub ae_title: String,
    /// Calling AE titles allowed to associate; empty: any.
    pub allowed_callers: Vec<String>,
    /// Peer IP addresses allowed to associate; empty: any.
    pub allowed_hosts: Vec<IpAddr>,
    /// Associations open at once; one more is rejected (transient, local limit exceeded).
    pub max_associations: usize,
    /// The largest data set accepted, in bytes; a larger one gets status 0xA700.
    pub max_object_bytes: u64,
    /// Where instances are stored: `<storage_dir>/<StudyInstanceUID>/<SOPInstanceUID>.dcm`.
    pub storage_dir: PathBuf,
    /// How long an association may wait for the peer (each read and write) before it is
    /// dropped.
    pub timeout: Duration,
}

impl ScpConfig {
    /// A node called `ae_title` storing under `storage_dir`, accepting any caller from any
    /// host, 8 associations at once, data sets up to 256 MiB (chest radiographs are far smaller; 8 at
    /// once stay within 2 GiB of memory), a 60 s timeout.
    pub fn new(ae_title: impl Into<String>, storage_dir: impl Into<PathBuf>) -> Self {
        Self {
            ae_title: ae_title.into(),
            allowed_callers: Vec::new(),
            allowed_hosts: Vec::new(),
            max_associations: 8,
            max_object_bytes: 256 << 20,
            storage_dir: storage_dir.into(),
            timeout: Duration::from_secs(60),
        }
    }
}

/// One instance stored by the node, as given to the `on_stored` callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredInstance {
    /// The Part 10 file, `<storage_dir>/<study_uid>/<sop_instance_uid>.dcm`.
    pub path: PathBuf,
    /// StudyInstanceUID (0020,000D) of the instance.
    pub study_uid: String,
    /// SeriesInstanceUID (0020,000E) of the instance.
    pub series_uid: String,
    /// SOPInstanceUID (0008,0018) of the instance.
    pub sop_instance_uid: String,
    /// SOPClassUID (0008,0016) of the instance.
    pub sop_class_uid: String,
    /// The negotiated transfer syntax the data set arrived (and is stored) in.
    pub transfer_syntax: String,
    /// Whether hilum-imaging decodes that transfer syntax ([`DECODABLE_TRANSFER_SYNTAXES`]).
    pub decodable: bool,
    /// The sender's AE title.
    pub calling_ae: String,
}

/// Called for each stored instance, on the association's thread, before the success status is
/// sent. `Err(reason)` makes the node answer [`status::NOT_QUEUED`] instead.
pub type OnStored = dyn Fn(&StoredInstance) -> Result<(), String> + Send + Sync;

/// Why the node could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ScpError {
    /// The listening socket could not be opened.
    #[error("the DICOM node cannot listen on {addr}: {source}; choose a free port (0 for any)")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The storage folder could not be created.
    #[error(
        "the DICOM node's storage folder {path} cannot be created: {source}; give a writable \
         folder"
    )]
    StorageDir {
        /// The folder asked for.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A setting is out of range; the message names it.
    #[error("invalid DICOM node setting: {0}")]
    Config(String),
}

/// Stops a running [`Scp`]: associations in progress finish, no new one is accepted.
#[derive(Debug, Clone)]
pub struct ShutdownHandle {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl ShutdownHandle {
    /// Asks [`Scp::run`] to return; it does once its accept call wakes (this connects to it).
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake.ip() {
                IpAddr::V4(_) => IpAddr::from([127, 0, 0, 1]),
                IpAddr::V6(_) => IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]),
            });
        }
        // The connection only wakes the accept call; a failure means it is not waiting.
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
    }
}

/// The DICOM node, bound and ready to [`run`](Scp::run).
pub struct Scp {
    listener: TcpListener,
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
}

/// What every association thread reads.
pub(crate) struct Shared {
    pub(crate) cfg: ScpConfig,
    pub(crate) on_stored: Option<Box<OnStored>>,
    pub(crate) active: AtomicUsize,
}

impl Scp {
    /// Binds the node's port (`"127.0.0.1:0"` for an ephemeral one) and creates the storage
    /// folder.
    pub fn bind(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        cfg: ScpConfig,
    ) -> Result<Self, ScpError> {
        let shown = format!("{addr:?}");
        if cfg.ae_title.trim().is_empty() || cfg.ae_title.trim().len() > 16 {
            return Err(ScpError::Config(format!(
                "ae_title {:?} must have 1 to 16 characters",
                cfg.ae_title
            )));
        }
        if cfg.max_associations == 0 {
            return Err(ScpError::Config(
                "max_associations is 0: no association could ever be accepted".into(),
            ));
        }
        std::fs::create_dir_all(&cfg.storage_dir).map_err(|source| ScpError::StorageDir {
            path: cfg.storage_dir.clone(),
            source,
        })?;
        let listener = TcpListener::bind(addr).map_err(|source| ScpError::Bind {
            addr: shown.clone(),
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| ScpError::Bind {
            addr: shown,
            source,
        })?;
        Ok(Self {
            listener,
            addr,
            shared: Arc::new(Shared {
                cfg,
                on_stored: None,
                active: AtomicUsize::new(0),
            }),
            stop: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Sets the callback told of each stored instance (see [`OnStored`]).
    pub fn on_stored(
        mut self,
        f: impl Fn(&StoredInstance) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.on_stored = Some(Box::new(f));
        }
        self
    }

    /// The address the node listens on (with the port chosen when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// A handle that stops [`run`](Scp::run) from another thread.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            stop: self.stop.clone(),
            addr: self.addr,
        }
    }

    /// Accepts associations, each on its own thread, until [`ShutdownHandle::shutdown`].
    pub fn run(self) -> Result<(), ScpError> {
        let cfg = &self.shared.cfg;
        info!(
            target: "hilum_pacs::scp",
            ae_title = %cfg.ae_title,
            addr = %self.addr,
            storage_dir = %cfg.storage_dir.display(),
            max_associations = cfg.max_associations,
            max_object_bytes = cfg.max_object_bytes,
            "DICOM node listening"
        );
        for conn in self.listener.incoming() {
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            let stream = match conn {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little and go on.
                    warn!(target: "hilum_pacs::scp", error = %e, "cannot accept a connection");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            self.dispatch(stream);
        }
        info!(target: "hilum_pacs::scp", addr = %self.addr, "DICOM node stopped");
        Ok(())
    }

    fn dispatch(&self, stream: TcpStream) {
        let cfg = &self.shared.cfg;
        let peer = match stream.peer_addr() {
            Ok(p) => p,
            Err(_) => return,
        };
        let peer_ip = peer.ip().to_canonical();
        if !cfg.allowed_hosts.is_empty()
            && !cfg
                .allowed_hosts
                .iter()
                .any(|h| h.to_canonical() == peer_ip)
        {
            warn!(
                target: "hilum_pacs::scp",
                peer = %peer,
                "association rejected: host not allowed (A-ASSOCIATE-RJ permanent, no reason given)"
            );
            let rj = AssociationRJ {
                result: AssociationRJResult::Permanent,
                source: AssociationRJSource::ServiceUser(
                    AssociationRJServiceUserReason::NoReasonGiven,
                ),
            };
            spawn_refusal(stream, rj, cfg.timeout);
            return;
        }
        // Claim a slot; give it back if over the limit.
        let before = self.shared.active.fetch_add(1, Ordering::SeqCst);
        if before >= cfg.max_associations {
            self.shared.active.fetch_sub(1, Ordering::SeqCst);
            warn!(
                target: "hilum_pacs::scp",
                peer = %peer,
                max_associations = cfg.max_associations,
                "association rejected: too many at once (A-ASSOCIATE-RJ transient, local limit \
                 exceeded)"
            );
            let rj = AssociationRJ {
                result: AssociationRJResult::Transient,
                source: AssociationRJSource::ServiceProviderPresentation(
                    AssociationRJServiceProviderPresentationReason::LocalLimitExceeded,
                ),
            };
            spawn_refusal(stream, rj, cfg.timeout);
            return;
        }
        let slot = Slot(self.shared.clone());
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name("dicom-association".into())
            .spawn(move || {
                let _slot = slot;
                association::serve(&shared, stream, peer);
            });
        if let Err(e) = spawned {
            // The closure (and with it the slot and the socket) is dropped.
            warn!(target: "hilum_pacs::scp", peer = %peer, error = %e, "cannot start an association thread");
        }
    }
}

/// An association slot, given back when the association's thread ends.
struct Slot(Arc<Shared>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Reads the peer's A-ASSOCIATE-RQ and answers `rj`, on a thread of its own so that a slow
/// peer does not hold the accept loop.
fn spawn_refusal(stream: TcpStream, rj: AssociationRJ, timeout: Duration) {
    let _ = std::thread::Builder::new()
        .name("dicom-refusal".into())
        .spawn(move || refuse(stream, rj, timeout.min(Duration::from_secs(10))));
}

fn refuse(mut stream: TcpStream, rj: AssociationRJ, timeout: Duration) {
    use std::io::Write;
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let mut buf = bytes::BytesMut::with_capacity(16 * 1024);
    // The request is read (and dropped) so that the peer is waiting for the answer.
    match dicom_ul::association::read_pdu_from_wire(
        &mut stream,
        &mut buf,
        dicom_ul::pdu::MAXIMUM_PDU_SIZE,
        false,
    ) {
        Ok(Pdu::AssociationRQ(_)) => {}
        _ => return,
    }
    let mut out = Vec::new();
    if dicom_ul::pdu::write_pdu(&mut out, &Pdu::AssociationRJ(rj)).is_ok() {
        let _ = stream.write_all(&out);
        let _ = stream.flush();
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}
