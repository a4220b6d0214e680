//! `hilum deid`: de-identified copies of DICOM files by PS3.15 Annex E (the library's
//! `export_deidentified`), with the profile options a site chooses as flags.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use hilum_imaging::{export_deidentified, DeidOptions};

#[derive(Args)]
#[command(after_help = "Examples:\n  hilum deid chest.dcm --out export/\n  \
HILUM_DEID_SALT=site-secret hilum deid study/*.dcm --out export/ --retain-modified-dates \
--date-shift-days -180 --retain-patient-characteristics\n\n\
Every attribute of DICOM PS3.15 Table E.1-1 (edition 2026c) gets its Basic Profile action: \
removed (X and the X/... choices), emptied (Z, Z/D), a dummy (D), or a new UID (U: \
2.25.<hash of salt and UID>, the same for the same original, so a series stays a series). \
Private attributes, overlays and curves are removed; sequences are de-identified item by item. \
Each file is written as OUT/<name>; one line per file tells what was done. A file flagged \
Burned In Annotation = YES is refused unless --allow-burned-in.")]
pub struct DeidArgs {
    /// DICOM files to de-identify.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Folder for the de-identified copies (created if missing); a copy never overwrites its
    /// input.
    #[arg(long)]
    pub out: PathBuf,
    /// Secret mixed into new UIDs and patient IDs. The same salt keeps a site's exports linked;
    /// without one, a random salt links only the files of this run.
    #[arg(long, env = "HILUM_DEID_SALT", hide_env_values = true)]
    pub salt: Option<String>,
    /// Retain Longitudinal Temporal Information with Modified Dates: shift every date by
    /// --date-shift-days instead of removing it (times are kept).
    #[arg(long)]
    pub retain_modified_dates: bool,
    /// Days to shift dates by under --retain-modified-dates (negative = earlier).
    #[arg(
        long,
        default_value_t = -100,
        allow_hyphen_values = true,
        requires = "retain_modified_dates"
    )]
    pub date_shift_days: i64,
    /// Retain Patient Characteristics: sex, age (90 and above as 090Y), size, weight, ethnic
    /// group, smoking and pregnancy status.
    #[arg(long)]
    pub retain_patient_characteristics: bool,
    /// Retain Device Identity: station name, device serial number, detector, plate and
    /// cassette IDs.
    #[arg(long)]
    pub retain_device_identity: bool,
    /// Export files flagged Burned In Annotation = YES too, once someone has checked that
    /// their pixels show no names or IDs.
    #[arg(long)]
    pub allow_burned_in: bool,
}

pub fn run(args: DeidArgs) -> anyhow::Result<()> {
    let mut opts = DeidOptions {
        date_shift_days: args.retain_modified_dates.then_some(args.date_shift_days),
        retain_patient_characteristics: args.retain_patient_characteristics,
        retain_device_identity: args.retain_device_identity,
        allow_burned_in_annotation: args.allow_burned_in,
        ..Default::default()
    };
    if let Some(salt) = args.salt {
        anyhow::ensure!(!salt.is_empty(), "--salt (HILUM_DEID_SALT) is empty");
        opts.salt = salt;
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let mut failed = 0;
    for file in &args.files {
        let name = file
            .file_name()
            .with_context(|| format!("{} names no file", file.display()))?;
        let target = args.out.join(name);
        let same = |a: &PathBuf, b: &PathBuf| match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        anyhow::ensure!(
            !same(file, &target),
            "{} would overwrite its own input: choose another --out",
            target.display()
        );
        let what = file.display().to_string();
        let result = std::fs::read(file)
            .with_context(|| format!("cannot read {what}"))
            .and_then(|bytes| Ok(export_deidentified(&bytes, &what, &opts)?));
        match result {
            Ok((out, report)) => {
                std::fs::write(&target, out)
                    .with_context(|| format!("cannot write {}", target.display()))?;
                println!(
                    "{} -> {}: {} removed, {} replaced, {} UIDs remapped, {} dates shifted",
                    what,
                    target.display(),
                    report.removed.len(),
                    report.replaced.len(),
                    report.uids_remapped,
                    report.dates_shifted
                );
                for w in report.warnings {
                    eprintln!("warning: {what}: {w}");
                }
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                failed += 1;
            }
        }
    }
    anyhow::ensure!(
        failed == 0,
        "{failed} of {} files not exported",
        args.files.len()
    );
    Ok(())
}
