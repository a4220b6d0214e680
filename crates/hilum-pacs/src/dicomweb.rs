//! A DICOMweb client (PS3.18): QIDO-RS searches, WADO-RS retrieval of instances and studies,
//! STOW-RS storage, and [`pull_study`], which writes a study's instances to a folder (what
//! `hilum pacs pull` calls).
//!
//! ```no_run
//! # async fn demo() -> Result<(), hilum_pacs::dicomweb::DicomWebError> {
//! use hilum_pacs::dicomweb::{pull_study, DicomWebClient, DicomWebConfig};
//! let client = DicomWebClient::new(DicomWebConfig::new("http://127.0.0.1:8042/dicom-web"))?;
//! for study in client.qido_studies(&[("ModalitiesInStudy", "CR")]).await? {
//!     let paths = pull_study(&client, &study.study_instance_uid, "/tmp/pulled".as_ref()).await?;
//!     println!("{} instances", paths.len());
//! }
//! # Ok(()) }
//! ```
//!
//! Results are DICOM JSON (PS3.18 F.2): each record keeps the whole JSON object and reads the
//! usual attributes; [`tag_str`], [`tag_strings`], [`tag_int`] and [`tag_items`] read any other
//! tag (`"0020000D"`). Instances travel as `multipart/related; type="application/dicom"`
//! ([`crate::multipart`]).
//!
//! Every error says what to check (the server not running, credentials, a UID that does not
//! exist, a size limit). No patient data goes into logs or error messages from this module: it
//! logs the method, the URL without its query string (QIDO filters may hold names or ids), the
//! status and counts; UIDs appear in URL paths.

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::{header, Method, StatusCode, Url};
use serde_json::Value;

use crate::multipart::{self, APPLICATION_DICOM};
use crate::PacsError;

/// `Accept` for instances: the instances as stored (`transfer-syntax=*`), so pixel data comes
/// back byte for byte.
pub const ACCEPT_DICOM_MULTIPART: &str =
    "multipart/related; type=\"application/dicom\"; transfer-syntax=*";
/// `Accept` for QIDO-RS results and STOW-RS responses.
pub const ACCEPT_DICOM_JSON: &str = "application/dicom+json";

/// Credentials sent with every request. `Debug` never shows the secret.
#[derive(Clone, Default)]
pub enum Auth {
    /// No credentials.
    #[default]
    None,
    /// `Authorization: Bearer <token>`.
    Bearer(String),
    /// HTTP basic authentication.
    Basic {
        /// User name.
        user: String,
        /// Password, never shown by `Debug`.
        password: String,
    },
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::None => f.write_str("None"),
            Auth::Bearer(_) => f.write_str("Bearer(<hidden>)"),
            Auth::Basic { user, .. } => write!(f, "Basic {{ user: {user:?}, password: <hidden> }}"),
        }
    }
}

/// Where the DICOMweb server is and how to talk to it.
#[derive(Clone, Debug)]
pub struct DicomWebConfig {
    /// The server's DICOMweb root, e.g. `http://127.0.0.1:8042/dicom-web` (Orthanc).
    pub base_url: String,
    /// Credentials sent with every request.
    pub auth: Auth,
    /// Time to open a connection (default 10 s).
    pub connect_timeout: Duration,
    /// Time for a whole request, body included (default 300 s; a large study needs more).
    pub timeout: Duration,
    /// Largest instance accepted in a WADO-RS response (default 1 GiB).
    pub max_part_bytes: usize,
    /// Largest response body accepted (default 4 GiB).
    pub max_response_bytes: usize,
}

impl DicomWebConfig {
    /// A configuration for the server at `base_url`, without credentials and with the default
    /// timeouts and size limits.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            auth: Auth::None,
            connect_timeout: Duration::from_secs(10),
            timeout: Duration::from_secs(300),
            max_part_bytes: 1 << 30,
            max_response_bytes: 4 << 30,
        }
    }

    /// Sends `Authorization: Bearer <token>` with every request.
    pub fn bearer(mut self, token: impl Into<String>) -> Self {
        self.auth = Auth::Bearer(token.into());
        self
    }

    /// Sends HTTP basic authentication with every request.
    pub fn basic(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.auth = Auth::Basic {
            user: user.into(),
            password: password.into(),
        };
        self
    }

    /// Sets the connection timeout and the whole-request timeout.
    pub fn timeouts(mut self, connect: Duration, request: Duration) -> Self {
        self.connect_timeout = connect;
        self.timeout = request;
        self
    }
}

/// Why a DICOMweb request failed, with what to check. URLs in messages have no query string.
#[derive(Debug, thiserror::Error)]
pub enum DicomWebError {
    /// The base URL is unusable (not http(s), with a query or fragment) or no client can be built.
    #[error(
        "invalid DICOMweb base URL {url:?}: {reason}; give the server's DICOMweb root, e.g. \
         http://127.0.0.1:8042/dicom-web"
    )]
    InvalidUrl {
        /// The base URL given (at most 200 characters).
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A study, series or instance UID given to a request is not a DICOM UID.
    #[error("invalid {what} {value:?}: a DICOM UID is 1 to 64 digits and dots")]
    InvalidUid {
        /// Which UID it is (study, series or instance).
        what: &'static str,
        /// The value given.
        value: String,
    },

    /// The server could not be connected to.
    #[error(
        "cannot reach {url} ({reason}): is the PACS at {base} running, and are the host and \
         port right?"
    )]
    Unreachable {
        /// The request's URL, without query string.
        url: String,
        /// The configured base URL.
        base: String,
        /// The connection error.
        reason: String,
    },

    /// The server did not answer within the request timeout.
    #[error(
        "{url} did not answer within {secs} s: is the PACS overloaded or the network down? A \
         large study may need a longer timeout"
    )]
    Timeout {
        /// The request's URL, without query string.
        url: String,
        /// The request timeout in seconds.
        secs: u64,
    },

    /// The server refused the credentials (HTTP 401 or 403).
    #[error(
        "{url} refused the request with HTTP {status}: check the credentials (bearer token, or \
         user and password) and that they allow {action}"
    )]
    Unauthorized {
        /// The request's URL, without query string.
        url: String,
        /// The HTTP status (401 or 403).
        status: u16,
        /// What the request was doing, e.g. `storing (STOW-RS)`.
        action: &'static str,
    },

    /// The server answered with an HTTP status the request does not accept.
    #[error("{url} answered HTTP {status}{hint}: {body:?}")]
    Http {
        /// The request's URL, without query string.
        url: String,
        /// The HTTP status.
        status: u16,
        /// What to check for this status, or empty.
        hint: &'static str,
        /// The first 200 characters of the response body.
        body: String,
    },

    /// The response's content type or body is not what DICOMweb specifies.
    #[error("{url} answered with something that is not a DICOMweb response: {reason}")]
    BadResponse {
        /// The request's URL, without query string.
        url: String,
        /// What is wrong with the response.
        reason: String,
    },

    /// The response body is over `max_response_bytes`.
    #[error(
        "the response from {url} is over {limit} bytes: raise max_response_bytes, or retrieve \
         fewer instances per request"
    )]
    TooLarge {
        /// The request's URL, without query string.
        url: String,
        /// `max_response_bytes`.
        limit: usize,
    },

    /// The request failed for another reason (TLS, protocol, body).
    #[error("the request to {url} failed: {reason}")]
    Request {
        /// The request's URL, without query string.
        url: String,
        /// The HTTP client's error.
        reason: String,
    },

    /// The STOW-RS request body could not be built from the objects given.
    #[error("cannot prepare the STOW-RS request: {0}")]
    Build(PacsError),

    /// A retrieved instance is not readable DICOM.
    #[error("instance {index} retrieved from {url} is not readable DICOM: {source}")]
    Dicom {
        /// The request's URL, without query string.
        url: String,
        /// The instance's position in the response, from 1.
        index: usize,
        /// Why it could not be read.
        source: PacsError,
    },

    /// A retrieved instance's SOPInstanceUID is not a UID, so it cannot name a file.
    #[error(
        "instance {index} retrieved from {url} has SOPInstanceUID {value:?}, which is not a UID \
         (1 to 64 digits and dots): nothing is written, as the UID names the file"
    )]
    BadInstanceUid {
        /// The request's URL, without query string.
        url: String,
        /// The instance's position in the response, from 1.
        index: usize,
        /// The SOPInstanceUID it carries.
        value: String,
    },

    /// A retrieved instance could not be written to disk.
    #[error("cannot write {path}: {source}; check that the folder is writable and has room")]
    Io {
        /// The file that could not be written.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// A study found by QIDO-RS.
#[derive(Clone, Debug, PartialEq)]
pub struct StudyRecord {
    /// StudyInstanceUID (0020,000D).
    pub study_instance_uid: String,
    /// ModalitiesInStudy (0008,0061).
    pub modalities: Vec<String>,
    /// NumberOfStudyRelatedSeries (0020,1206).
    pub number_of_series: Option<i64>,
    /// NumberOfStudyRelatedInstances (0020,1208).
    pub number_of_instances: Option<i64>,
    /// The study's whole DICOM JSON record, for attributes without a field here.
    pub json: Value,
}

/// A series found by QIDO-RS.
#[derive(Clone, Debug, PartialEq)]
pub struct SeriesRecord {
    /// SeriesInstanceUID (0020,000E).
    pub series_instance_uid: String,
    /// Modality (0008,0060).
    pub modality: Option<String>,
    /// SeriesNumber (0020,0011).
    pub series_number: Option<i64>,
    /// NumberOfSeriesRelatedInstances (0020,1209).
    pub number_of_instances: Option<i64>,
    /// The series' whole DICOM JSON record, for attributes without a field here.
    pub json: Value,
}

/// An instance found by QIDO-RS.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceRecord {
    /// SOPInstanceUID (0008,0018).
    pub sop_instance_uid: String,
    /// SOPClassUID (0008,0016).
    pub sop_class_uid: Option<String>,
    /// InstanceNumber (0020,0013).
    pub instance_number: Option<i64>,
    /// The instance's whole DICOM JSON record, for attributes without a field here.
    pub json: Value,
}

/// An instance the server did not store (FailedSOPSequence item).
#[derive(Clone, Debug, PartialEq)]
pub struct StowFailure {
    /// ReferencedSOPInstanceUID (0008,1155).
    pub sop_instance_uid: Option<String>,
    /// ReferencedSOPClassUID (0008,1150).
    pub sop_class_uid: Option<String>,
    /// FailureReason (0008,1197), e.g. 0xA700 out of resources, 0xC000 cannot understand.
    pub failure_reason: Option<i64>,
}

/// What a STOW-RS request stored (PS3.18 10.5.3).
#[derive(Clone, Debug, PartialEq)]
pub struct StowResponse {
    /// 200 all stored, 202 some failed or were stored with warnings, 409 none stored.
    pub status: u16,
    /// ReferencedSOPInstanceUID of each ReferencedSOPSequence (0008,1199) item.
    pub stored: Vec<String>,
    /// Each FailedSOPSequence (0008,1198) item.
    pub failed: Vec<StowFailure>,
    /// The whole DICOM JSON response.
    pub json: Value,
}

/// A DICOMweb client for one server.
#[derive(Clone, Debug)]
pub struct DicomWebClient {
    http: reqwest::Client,
    /// The root without a trailing slash.
    base: String,
    auth: Auth,
    timeout: Duration,
    max_part_bytes: usize,
    max_response_bytes: usize,
}

/// `scheme://host:port/path` of a URL: no user info, no query string.
pub fn redacted(url: &Url) -> String {
    let mut s = format!("{}://{}", url.scheme(), url.host_str().unwrap_or(""));
    if let Some(port) = url.port() {
        s.push_str(&format!(":{port}"));
    }
    s.push_str(url.path());
    s
}

fn check_uid(what: &'static str, uid: &str) -> Result<(), DicomWebError> {
    let ok = !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && !uid.starts_with('.')
        && !uid.ends_with('.')
        && !uid.contains("..");
    if ok {
        Ok(())
    } else {
        Err(DicomWebError::InvalidUid {
            what,
            value: uid.chars().take(80).collect(),
        })
    }
}

/// The first 200 characters of a body, for an error message.
fn body_head(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .take(200)
        .collect::<String>()
        .trim()
        .to_string()
}

/// The error's description and its causes, without the URL reqwest puts in (it may have a query).
fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut out = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

fn status_hint(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => " (the server refused the request as malformed)",
        404 => " (check the base URL and that the study, series or instance exists there)",
        406 => " (the server cannot send this media type: is the base URL its DICOMweb root?)",
        413 => " (the request is too large for the server: send fewer objects per request)",
        415 => " (the server does not accept multipart/related application/dicom here)",
        500..=599 => " (a server error: see the PACS's log)",
        _ => "",
    }
}

impl DicomWebClient {
    /// A client for the server `config` names; fails when the base URL is not a usable http(s)
    /// URL.
    pub fn new(config: DicomWebConfig) -> Result<Self, DicomWebError> {
        let invalid = |reason: String| DicomWebError::InvalidUrl {
            url: config.base_url.chars().take(200).collect(),
            reason,
        };
        let trimmed = config.base_url.trim().trim_end_matches('/');
        let url = Url::parse(trimmed).map_err(|e| invalid(e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(invalid("the scheme is not http or https".into()));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(invalid("a base URL has no query or fragment".into()));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(invalid(
                "credentials go in the auth setting, not in the URL".into(),
            ));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .timeout(config.timeout)
            .user_agent(concat!("hilum-pacs/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| invalid(describe(e)))?;
        Ok(Self {
            http,
            base: trimmed.to_string(),
            auth: config.auth,
            timeout: config.timeout,
            max_part_bytes: config.max_part_bytes,
            max_response_bytes: config.max_response_bytes,
        })
    }

    /// The DICOMweb root this client talks to.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str, query: &[(&str, &str)]) -> Result<Url, DicomWebError> {
        let mut url =
            Url::parse(&format!("{}{path}", self.base)).map_err(|e| DicomWebError::InvalidUrl {
                url: self.base.clone(),
                reason: e.to_string(),
            })?;
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        Ok(url)
    }

    /// Sends a request and returns the response when its status is one `ok` accepts, and its
    /// body (read up to the size limit).
    async fn send(
        &self,
        method: Method,
        url: Url,
        accept: &str,
        body: Option<(String, Vec<u8>)>,
        action: &'static str,
        ok: impl Fn(StatusCode) -> bool,
    ) -> Result<(StatusCode, Option<String>, Vec<u8>), DicomWebError> {
        let shown = redacted(&url);
        let mut req = self
            .http
            .request(method.clone(), url)
            .header(header::ACCEPT, accept);
        req = match &self.auth {
            Auth::None => req,
            Auth::Bearer(token) => req.bearer_auth(token),
            Auth::Basic { user, password } => req.basic_auth(user, Some(password)),
        };
        let sent_bytes = body.as_ref().map(|(_, b)| b.len()).unwrap_or(0);
        if let Some((content_type, bytes)) = body {
            req = req.header(header::CONTENT_TYPE, content_type).body(bytes);
        }
        let map_err = |e: reqwest::Error| {
            if e.is_timeout() {
                DicomWebError::Timeout {
                    url: shown.clone(),
                    secs: self.timeout.as_secs(),
                }
            } else if e.is_connect() {
                DicomWebError::Unreachable {
                    url: shown.clone(),
                    base: self.base.clone(),
                    reason: describe(e),
                }
            } else {
                DicomWebError::Request {
                    url: shown.clone(),
                    reason: describe(e),
                }
            }
        };
        let mut resp = req.send().await.map_err(map_err)?;
        let status = resp.status();
        let content_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(map_err)? {
            if bytes.len() + chunk.len() > self.max_response_bytes {
                return Err(DicomWebError::TooLarge {
                    url: shown,
                    limit: self.max_response_bytes,
                });
            }
            bytes.extend_from_slice(&chunk);
        }
        tracing::info!(
            method = %method,
            url = %shown,
            status = status.as_u16(),
            sent_bytes,
            received_bytes = bytes.len(),
            "dicomweb request"
        );
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            return Err(DicomWebError::Unauthorized {
                url: shown,
                status: status.as_u16(),
                action,
            });
        }
        if !ok(status) {
            return Err(DicomWebError::Http {
                url: shown,
                status: status.as_u16(),
                hint: status_hint(status),
                body: body_head(&bytes),
            });
        }
        Ok((status, content_type, bytes))
    }

    async fn qido(
        &self,
        path: &str,
        filters: &[(&str, &str)],
    ) -> Result<Vec<Value>, DicomWebError> {
        let url = self.url(path, filters)?;
        let shown = redacted(&url);
        let (status, _, body) = self
            .send(
                Method::GET,
                url,
                ACCEPT_DICOM_JSON,
                None,
                "searching (QIDO-RS)",
                |s| s.is_success(),
            )
            .await?;
        if status == StatusCode::NO_CONTENT || body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Vec::new());
        }
        match serde_json::from_slice(&body) {
            Ok(Value::Array(items)) => {
                tracing::info!(url = %shown, results = items.len(), "qido-rs");
                Ok(items)
            }
            Ok(_) => Err(DicomWebError::BadResponse {
                url: shown,
                reason: "the QIDO-RS result is not a JSON array".into(),
            }),
            Err(e) => Err(DicomWebError::BadResponse {
                url: shown,
                reason: format!("the body is not JSON ({e})"),
            }),
        }
    }

    fn required_uid(
        url: &str,
        item: &Value,
        tag: &str,
        name: &str,
    ) -> Result<String, DicomWebError> {
        tag_str(item, tag).ok_or_else(|| DicomWebError::BadResponse {
            url: url.to_string(),
            reason: format!("a result has no {name} ({tag})"),
        })
    }

    /// QIDO-RS `GET {base}/studies?filters` (e.g. `("ModalitiesInStudy", "CR")`,
    /// `("StudyInstanceUID", uid)`, `("limit", "10")`).
    pub async fn qido_studies(
        &self,
        filters: &[(&str, &str)],
    ) -> Result<Vec<StudyRecord>, DicomWebError> {
        let shown = format!("{}/studies", self.base);
        self.qido("/studies", filters)
            .await?
            .into_iter()
            .map(|json| {
                Ok(StudyRecord {
                    study_instance_uid: Self::required_uid(
                        &shown,
                        &json,
                        "0020000D",
                        "StudyInstanceUID",
                    )?,
                    modalities: tag_strings(&json, "00080061"),
                    number_of_series: tag_int(&json, "00201206"),
                    number_of_instances: tag_int(&json, "00201208"),
                    json,
                })
            })
            .collect()
    }

    /// QIDO-RS `GET {base}/studies/{study}/series?filters` (e.g. `("Modality", "SEG")`).
    pub async fn qido_series(
        &self,
        study_uid: &str,
        filters: &[(&str, &str)],
    ) -> Result<Vec<SeriesRecord>, DicomWebError> {
        check_uid("StudyInstanceUID", study_uid)?;
        let path = format!("/studies/{study_uid}/series");
        let shown = format!("{}{path}", self.base);
        self.qido(&path, filters)
            .await?
            .into_iter()
            .map(|json| {
                Ok(SeriesRecord {
                    series_instance_uid: Self::required_uid(
                        &shown,
                        &json,
                        "0020000E",
                        "SeriesInstanceUID",
                    )?,
                    modality: tag_str(&json, "00080060"),
                    series_number: tag_int(&json, "00200011"),
                    number_of_instances: tag_int(&json, "00201209"),
                    json,
                })
            })
            .collect()
    }

    /// QIDO-RS `GET {base}/studies/{study}/series/{series}/instances`.
    pub async fn qido_instances(
        &self,
        study_uid: &str,
        series_uid: &str,
    ) -> Result<Vec<InstanceRecord>, DicomWebError> {
        check_uid("StudyInstanceUID", study_uid)?;
        check_uid("SeriesInstanceUID", series_uid)?;
        let path = format!("/studies/{study_uid}/series/{series_uid}/instances");
        let shown = format!("{}{path}", self.base);
        self.qido(&path, &[])
            .await?
            .into_iter()
            .map(|json| {
                Ok(InstanceRecord {
                    sop_instance_uid: Self::required_uid(
                        &shown,
                        &json,
                        "00080018",
                        "SOPInstanceUID",
                    )?,
                    sop_class_uid: tag_str(&json, "00080016"),
                    instance_number: tag_int(&json, "00200013"),
                    json,
                })
            })
            .collect()
    }

    async fn wado(&self, path: &str) -> Result<Vec<Vec<u8>>, DicomWebError> {
        let url = self.url(path, &[])?;
        let shown = redacted(&url);
        let (_, content_type, body) = self
            .send(
                Method::GET,
                url,
                ACCEPT_DICOM_MULTIPART,
                None,
                "retrieving (WADO-RS)",
                |s| s == StatusCode::OK || s == StatusCode::PARTIAL_CONTENT,
            )
            .await?;
        let content_type = content_type.ok_or_else(|| DicomWebError::BadResponse {
            url: shown.clone(),
            reason: "the response has no Content-Type".into(),
        })?;
        let parts =
            multipart::parse_related(&content_type, &body, self.max_part_bytes).map_err(|e| {
                DicomWebError::BadResponse {
                    url: shown.clone(),
                    reason: e.to_string(),
                }
            })?;
        let mut out = Vec::with_capacity(parts.len());
        for (i, part) in parts.into_iter().enumerate() {
            let essence = multipart::MediaType::parse(&part.content_type).map(|m| m.essence);
            if essence.as_deref() != Some(APPLICATION_DICOM) {
                return Err(DicomWebError::BadResponse {
                    url: shown,
                    reason: format!(
                        "part {} is {:?}, not application/dicom",
                        i + 1,
                        part.content_type.chars().take(100).collect::<String>()
                    ),
                });
            }
            out.push(part.bytes);
        }
        tracing::info!(url = %shown, instances = out.len(), "wado-rs");
        Ok(out)
    }

    /// WADO-RS: one instance's Part 10 bytes, as the server stores them.
    pub async fn wado_instance(
        &self,
        study_uid: &str,
        series_uid: &str,
        instance_uid: &str,
    ) -> Result<Vec<u8>, DicomWebError> {
        check_uid("StudyInstanceUID", study_uid)?;
        check_uid("SeriesInstanceUID", series_uid)?;
        check_uid("SOPInstanceUID", instance_uid)?;
        let path = format!("/studies/{study_uid}/series/{series_uid}/instances/{instance_uid}");
        let mut parts = self.wado(&path).await?;
        if parts.len() != 1 {
            return Err(DicomWebError::BadResponse {
                url: format!("{}{path}", self.base),
                reason: format!("{} instances where one was asked for", parts.len()),
            });
        }
        Ok(parts.remove(0))
    }

    /// WADO-RS: every instance of a study, Part 10 bytes each.
    pub async fn wado_study(&self, study_uid: &str) -> Result<Vec<Vec<u8>>, DicomWebError> {
        check_uid("StudyInstanceUID", study_uid)?;
        self.wado(&format!("/studies/{study_uid}")).await
    }

    /// STOW-RS: stores Part 10 objects, `POST {base}/studies` or, with a study UID,
    /// `{base}/studies/{uid}` (the server then refuses objects of other studies). A response
    /// with status 200, 202 (some failed) or 409 (none stored) is a [`StowResponse`] listing
    /// what was stored and what failed.
    pub async fn stow(
        &self,
        study_uid: Option<&str>,
        objects: &[Vec<u8>],
    ) -> Result<StowResponse, DicomWebError> {
        let path = match study_uid {
            Some(uid) => {
                check_uid("StudyInstanceUID", uid)?;
                format!("/studies/{uid}")
            }
            None => "/studies".to_string(),
        };
        let url = self.url(&path, &[])?;
        let shown = redacted(&url);
        let contents: Vec<&[u8]> = objects.iter().map(Vec::as_slice).collect();
        let boundary = multipart::new_boundary_for(&contents);
        let (content_type, body) =
            multipart::build_related_dicom(objects, &boundary).map_err(DicomWebError::Build)?;
        let (status, _, body) = self
            .send(
                Method::POST,
                url,
                ACCEPT_DICOM_JSON,
                Some((content_type, body)),
                "storing (STOW-RS)",
                |s| s == StatusCode::OK || s == StatusCode::ACCEPTED || s == StatusCode::CONFLICT,
            )
            .await?;
        let json: Value = match serde_json::from_slice(&body) {
            // Some servers answer a one-element array.
            Ok(Value::Array(mut items)) if items.len() == 1 => items.remove(0),
            Ok(v @ Value::Object(_)) => v,
            Ok(_) => {
                return Err(DicomWebError::BadResponse {
                    url: shown,
                    reason: "the STOW-RS response is not a DICOM JSON object".into(),
                })
            }
            Err(e) if status == StatusCode::CONFLICT => {
                return Err(DicomWebError::Http {
                    url: shown,
                    status: 409,
                    hint: " (nothing was stored)",
                    body: format!("{} [not DICOM JSON: {e}]", body_head(&body)),
                })
            }
            Err(e) => {
                return Err(DicomWebError::BadResponse {
                    url: shown,
                    reason: format!("the body is not JSON ({e})"),
                })
            }
        };
        let stored = tag_items(&json, "00081199")
            .iter()
            .filter_map(|item| tag_str(item, "00081155"))
            .collect::<Vec<_>>();
        let failed = tag_items(&json, "00081198")
            .iter()
            .map(|item| StowFailure {
                sop_instance_uid: tag_str(item, "00081155"),
                sop_class_uid: tag_str(item, "00081150"),
                failure_reason: tag_int(item, "00081197"),
            })
            .collect::<Vec<_>>();
        tracing::info!(
            url = %shown,
            status = status.as_u16(),
            sent = objects.len(),
            stored = stored.len(),
            failed = failed.len(),
            "stow-rs"
        );
        Ok(StowResponse {
            status: status.as_u16(),
            stored,
            failed,
            json,
        })
    }
}

/// Retrieves every instance of a study (WADO-RS) and writes each as
/// `dest_dir/<SOPInstanceUID>.dcm`, atomically (a temporary file in the same folder, synced,
/// then renamed), creating `dest_dir` if needed. Returns the paths in the order the server sent
/// the instances. An instance that is not readable DICOM, or whose SOP Instance UID is not a
/// valid UID (it names the file), stops the pull before anything of it is written.
pub async fn pull_study(
    client: &DicomWebClient,
    study_uid: &str,
    dest_dir: &Path,
) -> Result<Vec<PathBuf>, DicomWebError> {
    let instances = client.wado_study(study_uid).await?;
    let url = format!("{}/studies/{study_uid}", client.base_url());
    // Name every file before writing any.
    let mut named = Vec::with_capacity(instances.len());
    for (i, bytes) in instances.into_iter().enumerate() {
        let obj = crate::read_dicom(&bytes).map_err(|source| DicomWebError::Dicom {
            url: url.clone(),
            index: i + 1,
            source,
        })?;
        // The data set's SOPInstanceUID names the file; the File Meta's copy when it has none.
        let uid = crate::source::text(&obj, dicom_dictionary_std::tags::SOP_INSTANCE_UID)
            .unwrap_or_else(|| {
                obj.meta()
                    .media_storage_sop_instance_uid()
                    .trim_end_matches(['\0', ' '])
                    .to_string()
            });
        if check_uid("SOPInstanceUID", &uid).is_err() {
            return Err(DicomWebError::BadInstanceUid {
                url: url.clone(),
                index: i + 1,
                value: uid.chars().take(80).collect(),
            });
        }
        named.push((uid, bytes));
    }
    let dest = dest_dir.to_path_buf();
    let count = named.len();
    let paths = tokio::task::spawn_blocking(move || -> Result<Vec<PathBuf>, DicomWebError> {
        std::fs::create_dir_all(&dest).map_err(|source| DicomWebError::Io {
            path: dest.clone(),
            source,
        })?;
        let mut paths = Vec::with_capacity(named.len());
        for (uid, bytes) in named {
            let path = dest.join(format!("{uid}.dcm"));
            write_atomically(&path, &bytes)?;
            paths.push(path);
        }
        Ok(paths)
    })
    .await
    .map_err(|e| DicomWebError::Io {
        path: dest_dir.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })??;
    tracing::info!(url = %url, instances = count, "pulled study");
    Ok(paths)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), DicomWebError> {
    use std::io::Write;
    let io = |source| DicomWebError::Io {
        path: path.to_path_buf(),
        source,
    };
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("instance");
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    // The rename itself survives a crash once the folder is synced (best effort off Unix).
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// The `Value` array of a DICOM JSON attribute (`tag` as 8 hex digits, either case); empty when
/// absent or without values.
pub fn tag_values<'a>(obj: &'a Value, tag: &str) -> &'a [Value] {
    let attr = obj
        .get(tag)
        .or_else(|| obj.get(tag.to_ascii_uppercase()))
        .or_else(|| obj.get(tag.to_ascii_lowercase()));
    attr.and_then(|a| a.get("Value"))
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

fn value_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        // Person names (PS3.18 F.2.2): the alphabetic form.
        Value::Object(o) => o
            .get("Alphabetic")
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// Every value of an attribute as text (numbers printed, person names' alphabetic form).
pub fn tag_strings(obj: &Value, tag: &str) -> Vec<String> {
    tag_values(obj, tag).iter().filter_map(value_text).collect()
}

/// The first value of an attribute as text; `None` when absent or empty.
pub fn tag_str(obj: &Value, tag: &str) -> Option<String> {
    tag_values(obj, tag)
        .first()
        .and_then(value_text)
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The first value of an attribute as an integer (IS may come as a number or a string).
pub fn tag_int(obj: &Value, tag: &str) -> Option<i64> {
    match tag_values(obj, tag).first()? {
        Value::Number(n) => n.as_i64().or_else(|| n.as_f64().map(|f| f as i64)),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// The items of a sequence attribute; empty when absent or empty.
pub fn tag_items<'a>(obj: &'a Value, tag: &str) -> &'a [Value] {
    tag_values(obj, tag)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn dicom_json_helpers() {
        let v = json!({
            "0020000D": {"vr": "UI", "Value": ["1.2.3"]},
            "00080061": {"vr": "CS", "Value": ["CR", "SR"]},
            "00201208": {"vr": "IS", "Value": [4]},
            "00200011": {"vr": "IS", "Value": [" 12 "]},
            "00100010": {"vr": "PN", "Value": [{"Alphabetic": "Doe^Jane"}]},
            "00080050": {"vr": "SH"},
            "00081199": {"vr": "SQ", "Value": [{"00081155": {"vr": "UI", "Value": ["9.8"]}}]}
        });
        assert_eq!(tag_str(&v, "0020000d").as_deref(), Some("1.2.3"));
        assert_eq!(tag_strings(&v, "00080061"), ["CR", "SR"]);
        assert_eq!(tag_int(&v, "00201208"), Some(4));
        assert_eq!(tag_int(&v, "00200011"), Some(12));
        assert_eq!(tag_str(&v, "00100010").as_deref(), Some("Doe^Jane"));
        assert_eq!(tag_str(&v, "00080050"), None);
        assert_eq!(tag_str(&v, "99990000"), None);
        let items = tag_items(&v, "00081199");
        assert_eq!(tag_str(&items[0], "00081155").as_deref(), Some("9.8"));
    }

    #[test]
    fn uids_urls_and_secrets() {
        assert!(check_uid("x", "1.2.840.10008.5.1.4.1.1.7").is_ok());
        for bad in ["", "1..2", ".1", "1.", "../etc", "1.2/3", &"1".repeat(65)] {
            assert!(check_uid("x", bad).is_err(), "{bad:?}");
        }
        let url = Url::parse("http://u:p@host:8042/dicom-web/studies?PatientName=Doe").unwrap();
        assert_eq!(redacted(&url), "http://host:8042/dicom-web/studies");
        let auth = format!(
            "{:?}",
            Auth::Basic {
                user: "u".into(),
                password: "secret".into()
            }
        );
        assert!(!auth.contains("secret"));
        assert!(!format!("{:?}", Auth::Bearer("tok".into())).contains("tok"));
        for bad in ["ftp://x/y", "not a url", "http://u:p@x/", "http://x/?a=b"] {
            let e = DicomWebClient::new(DicomWebConfig::new(bad)).unwrap_err();
            assert!(matches!(e, DicomWebError::InvalidUrl { .. }), "{bad}: {e}");
        }
        let c =
            DicomWebClient::new(DicomWebConfig::new("http://127.0.0.1:8042/dicom-web/")).unwrap();
        assert_eq!(c.base_url(), "http://127.0.0.1:8042/dicom-web");
        let u = c.url("/studies", &[("PatientName", "A B&C")]).unwrap();
        assert_eq!(
            u.as_str(),
            "http://127.0.0.1:8042/dicom-web/studies?PatientName=A+B%26C"
        );
    }
}
