//! Runs Hilum's DICOM node (C-ECHO, C-STORE) on a port, storing under a folder, and prints
//! each stored instance; the node's log lines go to stderr. Ctrl-C stops it.
//!
//! ```sh
//! cargo run -p hilum-pacs --example scp -- 11112 /tmp/hilum-scp
//! echoscu -aet MODALITY -aec HILUM 127.0.0.1 11112
//! storescu -aet MODALITY -aec HILUM -xy 127.0.0.1 11112 ../shared/data/cxr/dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm
//! ```
//!
//! Options after the folder: `--ae TITLE` (default HILUM), `--allow-caller TITLE` and
//! `--allow-host IP` (each repeatable; none: any), `--max-associations N` (8),
//! `--max-object-bytes N` (256 MiB), `--bind ADDR` (127.0.0.1).

use hilum_pacs::scp::{Scp, ScpConfig};

const USAGE: &str = "usage: scp PORT STORAGE_DIR [--ae TITLE] [--allow-caller TITLE]... \
                     [--allow-host IP]... [--max-associations N] [--max-object-bytes N] \
                     [--bind ADDR]";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(port), Some(dir)) = (args.first(), args.get(1)) else {
        return Err(USAGE.into());
    };
    let port: u16 = port
        .parse()
        .map_err(|_| format!("PORT {port:?} is not a port number; {USAGE}"))?;
    let mut cfg = ScpConfig::new("HILUM", dir);
    let mut bind = "127.0.0.1".to_string();
    let mut rest = args[2..].iter();
    while let Some(flag) = rest.next() {
        let value = rest
            .next()
            .ok_or_else(|| format!("{flag} needs a value; {USAGE}"))?;
        match flag.as_str() {
            "--ae" => cfg.ae_title = value.clone(),
            "--allow-caller" => cfg.allowed_callers.push(value.clone()),
            "--allow-host" => cfg.allowed_hosts.push(value.parse()?),
            "--max-associations" => cfg.max_associations = value.parse()?,
            "--max-object-bytes" => cfg.max_object_bytes = value.parse()?,
            "--bind" => bind = value.clone(),
            _ => return Err(format!("unknown option {flag}; {USAGE}").into()),
        }
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let scp = Scp::bind((bind.as_str(), port), cfg)?.on_stored(|i| {
        println!(
            "stored {} ({}, {}{}) from {}",
            i.path.display(),
            i.sop_class_uid,
            i.transfer_syntax,
            if i.decodable {
                ""
            } else {
                ", not decoded by Hilum"
            },
            i.calling_ae
        );
        Ok(())
    });
    eprintln!("DICOM node listening on {}", scp.local_addr());
    scp.run()?;
    Ok(())
}
