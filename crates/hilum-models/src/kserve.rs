//! A client of the KServe Open Inference Protocol v2 (NVIDIA Triton, KServe, MLServer) for the
//! CNNs' forward passes: readiness and model-metadata checks when a model connects,
//! `POST /v2/models/{name}/infer` with the binary tensor data extension where the server lists
//! it (JSON otherwise), timeouts, and retries on connection errors and 5xx answers.
//!
//! Blocking on purpose (reqwest's blocking client, which runs its own runtime thread): the
//! models run their forward passes on blocking threads, never on the async workers. Only FP32
//! tensors travel; their names and shapes are those of the graphs `hilum models export-triton`
//! writes, and pre- and postprocessing stay in Hilum, so outputs do not depend on where the
//! network ran.

use std::time::Duration;

use reqwest::blocking::{Client, RequestBuilder};
use serde_json::{json, Value};

use crate::{Backend, ModelError};

/// The header that splits a binary-extension body into its JSON part and the tensor bytes.
const HEADER_LENGTH: &str = "Inference-Header-Content-Length";
/// The first pause before a retry; it doubles with each further try.
const FIRST_PAUSE: Duration = Duration::from_millis(100);

/// Where the kserve backend sends forward passes, and how patiently.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KserveSettings {
    /// Base URL of the server's HTTP endpoint, e.g. `http://triton:8000`.
    pub url: String,
    /// Longest wait for one answer.
    pub timeout: Duration,
    /// Longest wait for a connection.
    pub connect_timeout: Duration,
    /// Further tries after a connection error or a 5xx answer (pauses of 100 ms, 200 ms, ...).
    pub retries: u32,
    /// Run in process on this backend while the server does not answer; `None`: such a call
    /// fails with an error that says what to do.
    pub fallback: Option<Backend>,
}

impl KserveSettings {
    /// `url` with a 30 s answer timeout, a 2 s connect timeout, two retries and no fallback.
    pub fn new(url: impl Into<String>) -> Self {
        KserveSettings {
            url: url.into(),
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(2),
            retries: 2,
            fallback: None,
        }
    }

    /// `url` with a configured answer timeout and retry count, bounded the same way wherever
    /// they come from: at least 1 s per answer, at most 10 retries.
    pub fn bounded(
        url: impl Into<String>,
        timeout_secs: Option<u64>,
        retries: Option<u64>,
    ) -> Self {
        let mut s = KserveSettings::new(url);
        if let Some(secs) = timeout_secs {
            s.timeout = Duration::from_secs(secs.max(1));
        }
        if let Some(n) = retries {
            s.retries = n.min(10) as u32;
        }
        s
    }
}

/// The configured server of `settings`, or the error that says how to configure one.
pub fn configured(settings: &crate::ModelSettings) -> Result<&KserveSettings, ModelError> {
    settings.remote.as_ref().ok_or(ModelError::NoRemote)
}

/// A tensor a served model takes or gives: its name and shape, `-1` for any size (the batch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// The tensor's name in the served model.
    pub name: String,
    /// Its dimensions; `-1` for any size.
    pub shape: Vec<i64>,
}

impl TensorSpec {
    /// A spec from a name and dimensions.
    pub fn new(name: &str, shape: &[i64]) -> Self {
        TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
        }
    }

    fn accepts(&self, shape: &[i64]) -> bool {
        self.shape.len() == shape.len()
            && self
                .shape
                .iter()
                .zip(shape)
                .all(|(&a, &b)| a == b || a < 0 || b < 0)
    }
}

/// One model on a KServe v2 server, checked against the tensors Hilum sends and reads.
pub struct KserveModel {
    client: Client,
    base: String,
    name: String,
    input: TensorSpec,
    output: TensorSpec,
    binary: bool,
    retries: u32,
    timeout: Duration,
}

/// One answer, read whole inside the retry loop (a server dying mid-body is retried too).
struct Reply {
    status: reqwest::StatusCode,
    header_length: Option<usize>,
    body: Vec<u8>,
}

impl Reply {
    /// The server's own message: its JSON `error`, else the start of the body.
    fn message(&self) -> String {
        let text = serde_json::from_slice::<Value>(&self.body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or_else(|| {
                String::from_utf8_lossy(&self.body)
                    .chars()
                    .take(300)
                    .collect()
            });
        format!("HTTP {}: {}", self.status.as_u16(), text.trim())
    }
}

impl KserveModel {
    /// Connects to model `name` at `settings.url`: the server must be ready, the model ready, and
    /// its metadata must declare `input` and `output` as FP32 tensors of those shapes.
    pub fn connect(
        settings: &KserveSettings,
        name: &str,
        input: TensorSpec,
        output: TensorSpec,
    ) -> Result<Self, ModelError> {
        let base = settings.url.trim().trim_end_matches('/').to_string();
        let remote = |reason: String| ModelError::Remote {
            url: base.clone(),
            reason,
        };
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(remote(
                "the URL must start with http:// or https:// (e.g. http://triton:8000)".into(),
            ));
        }
        let client = Client::builder()
            .connect_timeout(settings.connect_timeout)
            .timeout(settings.timeout)
            .build()
            .map_err(|e| remote(format!("cannot make an HTTP client: {e}")))?;
        let mut model = KserveModel {
            client,
            base: base.clone(),
            name: name.to_string(),
            input,
            output,
            binary: false,
            retries: settings.retries,
            timeout: settings.timeout,
        };
        let ready = model.send("GET /v2/health/ready", |c| {
            c.get(format!("{base}/v2/health/ready"))
        })?;
        if !ready.status.is_success() {
            return Err(ModelError::RemoteDown {
                url: base,
                reason: format!("it reports not ready ({})", ready.message()),
            });
        }
        // Server metadata lists the protocol extensions; without it, plain JSON tensors.
        let server = model.send("GET /v2", |c| c.get(format!("{base}/v2")))?;
        model.binary = server.status.is_success()
            && serde_json::from_slice::<Value>(&server.body)
                .ok()
                .and_then(|v| v["extensions"].as_array().cloned())
                .is_some_and(|e| e.iter().any(|x| x == "binary_tensor_data"));
        let missing = |reply: &Reply| {
            remote(format!(
                "it has no model `{name}` ready ({}): export it with `hilum models export-triton \
                 DIR {name}` and load DIR into the server",
                reply.message()
            ))
        };
        let path = format!("{base}/v2/models/{name}");
        let meta = model.send("GET model metadata", |c| c.get(&path))?;
        if !meta.status.is_success() {
            return Err(missing(&meta));
        }
        let ready = model.send("GET model ready", |c| c.get(format!("{path}/ready")))?;
        if !ready.status.is_success() {
            return Err(missing(&ready));
        }
        let meta: Value = serde_json::from_slice(&meta.body)
            .map_err(|e| remote(format!("model metadata of `{name}` is not JSON: {e}")))?;
        for (key, want) in [("inputs", &model.input), ("outputs", &model.output)] {
            check_tensor(&meta, key, want).map_err(|e| {
                remote(format!(
                    "model `{name}` is not the graph Hilum runs: {e}; re-export it with \
                     `hilum models export-triton DIR {name}`"
                ))
            })?;
        }
        Ok(model)
    }

    /// The served model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether tensors travel as raw bytes (the server has the binary tensor data extension).
    pub fn binary(&self) -> bool {
        self.binary
    }

    /// The output tensor's shape and values for one input tensor (`shape`, row-major `data`).
    pub fn infer(
        &self,
        shape: &[usize],
        data: &[f32],
    ) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let remote = |reason: String| ModelError::Remote {
            url: self.base.clone(),
            reason: format!("model `{}`: {reason}", self.name),
        };
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        if !self.input.accepts(&dims) || shape.iter().product::<usize>() != data.len() {
            return Err(remote(format!(
                "input {shape:?} with {} values does not fit {:?}",
                data.len(),
                self.input.shape
            )));
        }
        let url = format!("{}/v2/models/{}/infer", self.base, self.name);
        let reply = if self.binary {
            let header = json!({
                "inputs": [{
                    "name": self.input.name, "shape": shape, "datatype": "FP32",
                    "parameters": {"binary_data_size": data.len() * 4},
                }],
                "outputs": [{"name": self.output.name, "parameters": {"binary_data": true}}],
            });
            let mut body = serde_json::to_vec(&header).map_err(|e| remote(e.to_string()))?;
            let header_len = body.len();
            body.reserve(data.len() * 4);
            for v in data {
                body.extend_from_slice(&v.to_le_bytes());
            }
            self.send("POST infer", |c| {
                c.post(&url)
                    .header(HEADER_LENGTH, header_len)
                    .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                    .body(body.clone())
            })?
        } else {
            let request = json!({
                "inputs": [{"name": self.input.name, "shape": shape, "datatype": "FP32", "data": data}],
                "outputs": [{"name": self.output.name}],
            });
            self.send("POST infer", |c| c.post(&url).json(&request))?
        };
        if !reply.status.is_success() {
            return Err(remote(format!("inference failed: {}", reply.message())));
        }
        let (out_shape, values) = parse_output(&reply, &self.output.name).map_err(remote)?;
        let got: Vec<i64> = out_shape.iter().map(|&d| d as i64).collect();
        if !self.output.accepts(&got) || out_shape.iter().product::<usize>() != values.len() {
            return Err(remote(format!(
                "output `{}` came back as {out_shape:?} with {} values, expected {:?}",
                self.output.name,
                values.len(),
                self.output.shape
            )));
        }
        Ok((out_shape, values))
    }

    /// Sends a request, trying again after connection errors and 5xx answers; a server that
    /// still fails is [`ModelError::RemoteDown`]. Timeouts are not retried: the caller already
    /// waited the whole timeout.
    fn send(
        &self,
        what: &str,
        request: impl Fn(&Client) -> RequestBuilder,
    ) -> Result<Reply, ModelError> {
        let mut pause = FIRST_PAUSE;
        let mut tries = 0;
        loop {
            tries += 1;
            let failure = match request(&self.client).send().and_then(|r| {
                let status = r.status();
                let header_length = r
                    .headers()
                    .get(HEADER_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse().ok());
                let body = r.bytes()?.to_vec();
                Ok(Reply {
                    status,
                    header_length,
                    body,
                })
            }) {
                Ok(reply) if reply.status.is_server_error() => reply.message(),
                Ok(reply) => return Ok(reply),
                Err(e) if e.is_timeout() => {
                    return Err(ModelError::RemoteDown {
                        url: self.base.clone(),
                        reason: format!("{what}: no answer within {:?}", self.timeout),
                    })
                }
                Err(e) => error_chain(&e),
            };
            if tries > self.retries {
                return Err(ModelError::RemoteDown {
                    url: self.base.clone(),
                    reason: format!("{what}: {failure} ({tries} tries)"),
                });
            }
            std::thread::sleep(pause);
            pause *= 2;
        }
    }
}

/// The error with its causes ("error sending request ...: connection refused").
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
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

/// Checks that the metadata's `key` list (`inputs` / `outputs`) declares `want` as FP32 with a
/// compatible shape.
fn check_tensor(meta: &Value, key: &str, want: &TensorSpec) -> Result<(), String> {
    let list = meta[key]
        .as_array()
        .ok_or_else(|| format!("its metadata has no `{key}` list"))?;
    let kind = key.trim_end_matches('s');
    let Some(t) = list.iter().find(|t| t["name"] == want.name.as_str()) else {
        let names: Vec<&str> = list.iter().filter_map(|t| t["name"].as_str()).collect();
        return Err(format!(
            "it has no {kind} `{}` (its {key}: {})",
            want.name,
            names.join(", ")
        ));
    };
    let datatype = t["datatype"].as_str().unwrap_or("?");
    if datatype != "FP32" {
        return Err(format!("{kind} `{}` is {datatype}, not FP32", want.name));
    }
    let shape: Option<Vec<i64>> = t["shape"]
        .as_array()
        .and_then(|s| s.iter().map(Value::as_i64).collect());
    match shape {
        Some(s) if want.accepts(&s) => Ok(()),
        Some(s) => Err(format!(
            "{kind} `{}` has shape {s:?}, Hilum uses {:?}",
            want.name, want.shape
        )),
        None => Err(format!("{kind} `{}` has no shape", want.name)),
    }
}

/// The named output of an infer reply: from the binary section when the server sent it there,
/// else from its JSON `data`.
fn parse_output(reply: &Reply, name: &str) -> Result<(Vec<usize>, Vec<f32>), String> {
    let (head, mut tail) = match reply.header_length {
        Some(n) if n <= reply.body.len() => reply.body.split_at(n),
        Some(n) => {
            return Err(format!(
                "the reply's JSON header is said to be {n} bytes of {}",
                reply.body.len()
            ))
        }
        None => (&reply.body[..], &[][..]),
    };
    let v: Value =
        serde_json::from_slice(head).map_err(|e| format!("the reply is not JSON: {e}"))?;
    let outputs = v["outputs"]
        .as_array()
        .ok_or("the reply has no `outputs`")?;
    for o in outputs {
        let size = o["parameters"]["binary_data_size"]
            .as_u64()
            .map(|n| n as usize);
        let bytes = match size {
            Some(n) if n <= tail.len() => {
                let (b, rest) = tail.split_at(n);
                tail = rest;
                Some(b)
            }
            Some(n) => return Err(format!("output of {n} bytes, {} left", tail.len())),
            None => None,
        };
        if o["name"] != name {
            continue;
        }
        if o["datatype"].as_str() != Some("FP32") {
            return Err(format!("output `{name}` is {}, not FP32", o["datatype"]));
        }
        let shape: Vec<usize> = o["shape"]
            .as_array()
            .and_then(|s| s.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .ok_or_else(|| format!("output `{name}` has no shape"))?;
        let values = match bytes {
            Some(b) if b.len() % 4 == 0 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Some(b) => return Err(format!("output `{name}` has {} bytes", b.len())),
            None => o["data"]
                .as_array()
                .and_then(|d| d.iter().map(|x| x.as_f64().map(|x| x as f32)).collect())
                .ok_or_else(|| format!("output `{name}` has no flat numeric `data`"))?,
        };
        return Ok((shape, values));
    }
    Err(format!("the reply has no output `{name}`"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_match_with_a_free_batch() {
        let t = TensorSpec::new("x", &[-1, 1, 224, 224]);
        assert!(t.accepts(&[-1, 1, 224, 224]));
        assert!(t.accepts(&[4, 1, 224, 224]));
        assert!(!t.accepts(&[4, 3, 224, 224]));
        assert!(!t.accepts(&[1, 224, 224]));
    }

    #[test]
    fn metadata_mismatches_name_what_differs() {
        let meta = json!({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],
                          "outputs": [{"name": "y", "datatype": "FP16", "shape": [-1, 18]}]});
        let shape = check_tensor(&meta, "inputs", &TensorSpec::new("x", &[-1, 1, 224, 224]));
        assert!(shape.is_err_and(|e| e.contains("[-1, 3, 224, 224]")));
        let name = check_tensor(&meta, "outputs", &TensorSpec::new("logits", &[-1, 18]));
        assert!(name.is_err_and(|e| e.contains("no output `logits`") && e.contains("y")));
        let dtype = check_tensor(&meta, "outputs", &TensorSpec::new("y", &[-1, 18]));
        assert!(dtype.is_err_and(|e| e.contains("FP16")));
    }

    #[test]
    fn binary_and_json_outputs_parse() {
        let head = json!({"outputs": [
            {"name": "other", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}},
            {"name": "y", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": 8}},
        ]});
        let mut body = serde_json::to_vec(&head).expect("json");
        let n = body.len();
        for v in [9.0f32, 1.5, -2.25] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        let reply = Reply {
            status: reqwest::StatusCode::OK,
            header_length: Some(n),
            body,
        };
        assert_eq!(
            parse_output(&reply, "y"),
            Ok((vec![1, 2], vec![1.5, -2.25]))
        );
        let json_reply = Reply {
            status: reqwest::StatusCode::OK,
            header_length: None,
            body: br#"{"outputs":[{"name":"y","datatype":"FP32","shape":[2],"data":[0.5,2]}]}"#
                .to_vec(),
        };
        assert_eq!(
            parse_output(&json_reply, "y"),
            Ok((vec![2], vec![0.5, 2.0]))
        );
        assert!(parse_output(&json_reply, "z").is_err());
    }

    #[test]
    fn a_closed_port_is_the_server_down_error_after_the_retries() {
        // Bind then drop a listener: the port is closed for the duration of the test.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let mut s = KserveSettings::new(format!("http://127.0.0.1:{port}/"));
        s.retries = 1;
        let t0 = std::time::Instant::now();
        let err = KserveModel::connect(
            &s,
            "m",
            TensorSpec::new("x", &[-1]),
            TensorSpec::new("y", &[-1]),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(
            err.contains("is not answering") && err.contains("2 tries"),
            "{err}"
        );
        assert!(
            err.contains("HILUM_KSERVE_URL") && err.contains("export-triton"),
            "{err}"
        );
        assert!(t0.elapsed() >= FIRST_PAUSE);
    }
}
