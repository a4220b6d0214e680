//! Real peers of the DICOM node tests, shared by hilum-server's and hilum-cli's tests: a
//! throw-away Orthanc (scripts/deploy/orthanc_start.sh), free ports, dcmtk's presence, and a TCP
//! forwarder that brings a "stopped" PACS back on its old address.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The first of dcmtk's storescu and Orthanc that is not installed.
pub fn tools_missing() -> Option<String> {
    for tool in ["storescu", "Orthanc"] {
        let found = Command::new("sh")
            .args([
                "-c",
                &format!("command -v {tool} || test -x /usr/sbin/{tool}"),
            ])
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Some(tool.to_string());
        }
    }
    None
}

/// An Orthanc started by scripts/deploy/orthanc_start.sh; killed and its files removed when dropped.
pub struct Orthanc {
    pub url: String,
    pub pid: u32,
    pub work: PathBuf,
}

impl Drop for Orthanc {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.pid.to_string()).status();
        std::thread::sleep(Duration::from_millis(300));
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// An Orthanc; with `hilum_dicom_port`, one that knows Hilum's node there as modality `hilum`.
pub fn orthanc(hilum_dicom_port: Option<u16>) -> Orthanc {
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("scripts/deploy/orthanc_start.sh"))
        .arg(env!("CARGO_TARGET_TMPDIR"));
    if let Some(port) = hilum_dicom_port {
        cmd.env("HILUM_ORTHANC_MODALITY", format!("HILUM@127.0.0.1:{port}"));
    }
    let out = cmd.output().expect("run scripts/deploy/orthanc_start.sh");
    assert!(
        out.status.success(),
        "scripts/deploy/orthanc_start.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let var = |name: &str| {
        stdout
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!("export {name}="))
                    .map(str::to_string)
            })
            .unwrap_or_else(|| panic!("orthanc_start.sh printed no {name}"))
    };
    Orthanc {
        url: var("HILUM_ORTHANC_URL"),
        pid: var("HILUM_ORTHANC_PID").parse().expect("pid"),
        work: PathBuf::from(var("HILUM_ORTHANC_WORK")),
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Forwards every connection on `listener` to `to` (a PACS coming back on its old address).
pub async fn forward(listener: tokio::net::TcpListener, to: String) {
    while let Ok((mut inbound, _)) = listener.accept().await {
        let to = to.clone();
        tokio::spawn(async move {
            if let Ok(mut outbound) = tokio::net::TcpStream::connect(&to).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}
