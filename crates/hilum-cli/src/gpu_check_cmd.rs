//! `hilum gpu-check`: every model on a GPU against the CPU with the same weights and inputs
//! (one tolerance per model), the forward passes timed on both, one table.

use std::path::PathBuf;
use std::str::FromStr;

use anyhow::Context;
use clap::Args;

use hilum_models::devcheck::{self, CheckOptions, CheckRow, Gray};
use hilum_models::{Device, DeviceSet};

#[derive(Args)]
#[command(after_help = "Examples:\n  hilum gpu-check\n  \
hilum gpu-check --device cuda:1 --image chest.png --json gpu.json\n  \
hilum gpu-check --device auto        # every GPU in turn (or a list: cuda:0,cuda:1)\n  \
hilum gpu-check --dry-run            # no GPU: the CPU against itself, small sizes\n\n\
Weights are seeded at each architecture's full size (no downloads), except the lung U-Net: its \
installed weights are used when present (or --unet PATH). A row fails when the target's output \
differs from the CPU's by more than its tolerance (max |gpu - cpu| / max(1, max |cpu|)). \
Columns: target ms (the device), cpu ms (candle on the CPU, the reference; timed at batch 1), \
native ms (Hilum's own CPU kernels, the CPU default, where the model has them). \
Exit status 1 when any row fails. scripts/gpu_check.sh builds the CUDA binary and runs this.")]
pub struct GpuCheckArgs {
    /// The device to check against the CPU; `auto` or a list (`cuda:0,cuda:1`) checks each
    /// in turn.
    #[arg(long, default_value = "cuda:0")]
    pub device: String,
    /// No GPU: run the CPU against itself with small sizes and one timed call (plumbing only).
    #[arg(long)]
    pub dry_run: bool,
    /// Timed calls per measurement on the target (after one warm-up; the CPU gets at most 2).
    #[arg(short = 'n', long, default_value_t = 5)]
    pub iterations: usize,
    /// A radiograph (PNG, JPEG, DICOM) for the image models; seeded noise otherwise.
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// The lung U-Net's model.safetensors (default: the installed lung-unet, if any, in
    /// HILUM_MODELS_DIR or the default models dir).
    #[arg(long)]
    pub unet: Option<PathBuf>,
    /// Run only these checks (densenet121, resnet50, lung-unet, pspnet, medsam, report,
    /// llava-slice, local-llm, medgemma).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Also write the rows as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(args: GpuCheckArgs) -> anyhow::Result<()> {
    for o in &args.only {
        anyhow::ensure!(
            devcheck::check_names().contains(&o.as_str()) || LOCAL_CHECKS.contains(&o.as_str()),
            "unknown check `{o}`; the checks are {}, {}",
            devcheck::check_names().join(", "),
            LOCAL_CHECKS.join(", ")
        );
    }
    let targets = if args.dry_run {
        DeviceSet::default()
    } else {
        DeviceSet::from_str(&args.device).map_err(|e| anyhow::anyhow!("--device: {e}"))?
    };
    // Open the devices first: a missing driver or a CPU-only build is one clear error.
    for target in targets.devices() {
        target.candle().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let image = match &args.image {
        Some(p) => {
            let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
            let img = hilum_imaging::decode(&bytes, &p.display().to_string(), 100_000_000)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            Some(Gray {
                max_value: img.max_value(),
                width: img.width as usize,
                height: img.height as usize,
                pixels: img.pixels,
            })
        }
        None => None,
    };
    let unet_weights = args.unet.clone().or_else(|| {
        let p = crate::config::models_dir()
            .join("lung-unet")
            .join("model.safetensors");
        p.exists().then_some(p)
    });
    let mut docs = Vec::new();
    let (mut failed, mut checks) = (Vec::new(), 0);
    for &target in targets.devices() {
        let opts = CheckOptions {
            reference: Device::Cpu,
            target,
            quick: args.dry_run,
            iterations: if args.dry_run { 1 } else { args.iterations },
            image: image.clone(),
            unet_weights: unet_weights.clone(),
            only: args.only.clone(),
        };
        let rows = check_one(&opts);
        checks += rows.len();
        let prefix = if targets.len() > 1 {
            format!("{target} ")
        } else {
            String::new()
        };
        failed.extend(
            rows.iter()
                .filter(|r| !r.passed)
                .map(|r| format!("{prefix}{}", r.model)),
        );
        docs.push(serde_json::json!({
            "target": target.to_string(),
            "reference": "cpu",
            "dry_run": args.dry_run,
            "rows": rows,
        }));
    }
    if let Some(path) = &args.json {
        // One device: its document, as before; several: one document per device.
        let doc = match <[_; 1]>::try_from(docs) {
            Ok([one]) => one,
            Err(docs) => serde_json::json!({
                "reference": "cpu",
                "dry_run": args.dry_run,
                "targets": docs,
            }),
        };
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    anyhow::ensure!(failed.is_empty(), "failed: {}", failed.join(", "));
    let on = if targets.len() > 1 {
        format!(" on {targets}")
    } else {
        String::new()
    };
    eprintln!("all {checks} checks passed{on}");
    Ok(())
}

/// One device's table, printed as its rows come.
fn check_one(opts: &CheckOptions) -> Vec<CheckRow> {
    let target = opts.target;
    eprintln!(
        "checking {target} against cpu{}",
        if opts.quick {
            " (dry run: small sizes)"
        } else {
            ""
        }
    );
    println!(
        "{:<12} {:>10} {:>8} {:<5} {:<28} {:>11} {:>11} {:>7} {:>11} {:>7}",
        "model",
        "rel diff",
        "tol",
        "ok",
        "timed",
        "target ms",
        "cpu ms",
        "ratio",
        "native ms",
        "ratio"
    );
    let mut rows = devcheck::run(opts, print_row);
    for &name in LOCAL_CHECKS {
        if opts.only.is_empty() || opts.only.iter().any(|o| o == name) {
            let row = local_row(name, opts);
            print_row(&row);
            rows.push(row);
        }
    }
    rows
}

/// The in-process GGUF engine's checks (`hilum-llm-local` runs them: the models crate does not
/// know that engine): the default local model's architecture, and MedGemma's.
const LOCAL_CHECKS: &[&str] = &["local-llm", "medgemma"];

fn local_row(name: &str, opts: &CheckOptions) -> CheckRow {
    use hilum_llm_local::devcheck;
    let checked = opts
        .target
        .to_string()
        .parse::<hilum_llm_local::LocalDevice>()
        .map_err(|e| e.to_string())
        .and_then(|target| {
            let run = if name == "medgemma" {
                devcheck::run_vlm
            } else {
                devcheck::run
            };
            run(target, opts.quick, opts.iterations).map_err(|e| e.to_string())
        });
    match checked {
        Ok(c) => CheckRow {
            model: name.into(),
            compared: c.compared.clone(),
            max_rel_diff: Some(c.max_rel_diff),
            tolerance: c.tolerance,
            passed: c.passed(),
            notes: c.notes.clone(),
            timings: c
                .timings
                .iter()
                .map(|t| hilum_models::devcheck::Timing {
                    what: t.what.clone(),
                    target_ms: t.target_ms,
                    reference_ms: t.reference_ms,
                    native_ms: t.native_ms,
                })
                .collect(),
            error: None,
        },
        Err(e) => CheckRow::failed(name, e),
    }
}

fn print_row(r: &CheckRow) {
    if let Some(e) = &r.error {
        println!("{:<12} ERROR: {e}", r.model);
        return;
    }
    let diff = r.max_rel_diff.map_or("-".into(), |d| format!("{d:.2e}"));
    let ok = if r.passed { "yes" } else { "NO" };
    let mut first = true;
    for t in &r.timings {
        let vs = |ms: Option<f64>| match ms {
            Some(c) => (
                format!("{c:.2}"),
                format!("{:.1}x", c / t.target_ms.max(1e-9)),
            ),
            None => ("-".into(), "-".into()),
        };
        let (cpu, ratio) = vs(t.reference_ms);
        let (native, native_ratio) = vs(t.native_ms);
        if first {
            println!(
                "{:<12} {:>10} {:>8.0e} {:<5} {:<28} {:>11.2} {:>11} {:>7} {:>11} {:>7}",
                r.model,
                diff,
                r.tolerance,
                ok,
                t.what,
                t.target_ms,
                cpu,
                ratio,
                native,
                native_ratio
            );
            first = false;
        } else {
            println!(
                "{:<12} {:>10} {:>8} {:<5} {:<28} {:>11.2} {:>11} {:>7} {:>11} {:>7}",
                "", "", "", "", t.what, t.target_ms, cpu, ratio, native, native_ratio
            );
        }
    }
    for n in &r.notes {
        println!("{:<12} {n}", "");
    }
}
