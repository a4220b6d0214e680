//! A Triton Inference Server model repository for the CNNs whose ONNX graphs Hilum has, so a
//! hospital's Triton serves them to the kserve backend (`hilum models export-triton DIR`):
//!
//! ```text
//! DIR/<model id>/config.pbtxt      platform onnxruntime_onnx, FP32 tensors, max_batch_size,
//!                                  dynamic_batching, one instance_group per GPU (or KIND_CPU)
//! DIR/<model id>/1/model.onnx      the graph Hilum runs on ONNX Runtime: built from the
//!                                  installed weights (classifiers, PSPNet, MedSAM's image
//!                                  encoder) or the imported model.onnx
//! ```
//!
//! The model is named by its Hilum id, which is the name the kserve backend asks the server for.
//! Tensor names and shapes are read from the graph itself, so the config cannot drift from it.

use std::path::{Path, PathBuf};

use crate::architecture::{Architecture, Graph};
use crate::onnx_graph::{graph_io, ValueSpec};
use crate::{Device, InstalledModel, Manifest, ModelError, ModelRegistry};

/// How the exported models are to be served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportOptions {
    /// GPUs 0..gpus each get an instance group (`KIND_GPU`); 0: instances on the CPU.
    pub gpus: usize,
    /// Model instances per GPU, or on the CPU.
    pub instances: usize,
    /// Largest batch Triton's dynamic batcher forms (ignored for graphs with a fixed batch).
    pub max_batch_size: usize,
    /// How long the batcher may hold a request to fill a batch, in microseconds.
    pub max_queue_delay_us: u64,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            gpus: 0,
            instances: 1,
            max_batch_size: 16,
            max_queue_delay_us: 1000,
        }
    }
}

/// What `export_triton` did with one model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exported {
    /// The model's directory was written.
    Written {
        /// Model id.
        id: String,
        /// `DIR/<id>`.
        dir: PathBuf,
        /// "built from the installed weights" or "the imported model.onnx".
        graph: &'static str,
        /// The graph's input tensor.
        input: ValueSpec,
        /// The graph's output tensor.
        output: ValueSpec,
        /// 0 when the graph's batch size is fixed.
        max_batch_size: usize,
    },
    /// The model was left out.
    Skipped {
        /// Model id.
        id: String,
        /// Why (not installed, no graph for its architecture, ...).
        reason: String,
    },
}

/// Writes the repository into `dir` for `ids`, or, when `ids` is empty, for every installed
/// model Hilum has a graph of (the others are listed as skipped). Named models must be
/// installed and have a graph; all are checked before anything is written.
pub fn export_triton(
    registry: &ModelRegistry,
    dir: &Path,
    ids: &[String],
    opts: &ExportOptions,
) -> Result<Vec<Exported>, ModelError> {
    let explicit = !ids.is_empty();
    let ids: Vec<String> = if explicit {
        ids.to_vec()
    } else {
        registry.manifests().map(|m| m.id.clone()).collect()
    };
    let mut plan = Vec::new();
    let mut out = Vec::new();
    for id in &ids {
        let manifest = registry.manifest(id)?;
        let skip = |reason: String| Exported::Skipped {
            id: id.clone(),
            reason,
        };
        let arch = registry.architectures().of(manifest)?;
        if arch.graph() == Graph::None {
            let reason = format!(
                "Hilum builds no ONNX graph for the `{}` architecture",
                manifest.architecture
            );
            if explicit {
                return Err(ModelError::Backend {
                    what: format!("{id} ({reason})"),
                    backend: crate::Backend::Kserve,
                    supported: "native or candle in process".into(),
                });
            }
            out.push(skip(reason));
            continue;
        }
        match registry.installed(id) {
            Ok(installed) => plan.push((manifest, installed)),
            Err(e @ ModelError::NotInstalled { .. }) if explicit => return Err(e),
            Err(ModelError::NotInstalled { .. }) => out.push(skip("not installed".into())),
            Err(e) => return Err(e),
        }
    }
    // Build every graph before writing, so a failure leaves no half-written repository.
    let mut graphs = Vec::new();
    for (manifest, installed) in plan {
        let arch = registry.architectures().of(manifest)?;
        let (bytes, graph) = graph_of(arch, manifest, &installed)?;
        let io = graph_io(&bytes).map_err(|reason| ModelError::Corrupt {
            id: manifest.id.clone(),
            reason: format!("its ONNX graph: {reason}"),
        })?;
        let (input, output, batched) = single_float_io(&manifest.id, &io)?;
        graphs.push((manifest.id.clone(), bytes, graph, input, output, batched));
    }
    for (id, bytes, graph, input, output, batched) in graphs {
        let model_dir = dir.join(&id);
        let version = model_dir.join("1");
        std::fs::create_dir_all(&version).map_err(|e| ModelError::io(&version, e))?;
        let onnx = version.join("model.onnx");
        std::fs::write(&onnx, &bytes).map_err(|e| ModelError::io(&onnx, e))?;
        let max_batch_size = if batched {
            opts.max_batch_size.max(1)
        } else {
            0
        };
        let text = config_pbtxt(&id, &input, &output, max_batch_size, opts);
        let config = model_dir.join("config.pbtxt");
        std::fs::write(&config, text).map_err(|e| ModelError::io(&config, e))?;
        out.push(Exported::Written {
            id,
            dir: model_dir,
            graph,
            input,
            output,
            max_batch_size,
        });
    }
    Ok(out)
}

/// The graph of one installed model: its imported `model.onnx`, else the one its architecture
/// builds from the weights.
fn graph_of(
    arch: &dyn Architecture,
    manifest: &Manifest,
    installed: &InstalledModel,
) -> Result<(Vec<u8>, &'static str), ModelError> {
    if let Some(path) = &installed.onnx {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        return Ok((bytes, "the imported model.onnx"));
    }
    if arch.graph() != Graph::Built {
        let file = manifest.source.onnx_file.as_deref().unwrap_or("MODEL.onnx");
        return Err(ModelError::Onnx(format!(
            "`{}` is served from its imported ONNX graph: run `hilum models import {} {file}`",
            manifest.id, manifest.id
        )));
    }
    let vb = crate::weights::var_builder(&installed.weights, Device::Cpu)?;
    let bytes = arch.onnx_graph(manifest, vb).map_err(|e| match e {
        ModelError::Compute(reason) => ModelError::Corrupt {
            id: manifest.id.clone(),
            reason,
        },
        other => other,
    })?;
    Ok((bytes, "built from the installed weights"))
}

/// The one FP32 input and output, and whether their first dimension is a free batch.
fn single_float_io(
    id: &str,
    io: &crate::onnx_graph::GraphIo,
) -> Result<(ValueSpec, ValueSpec, bool), ModelError> {
    let bad = |reason: String| ModelError::Corrupt {
        id: id.to_string(),
        reason: format!("its ONNX graph {reason}"),
    };
    let (Some(input), Some(output), 1, 1) = (
        io.inputs.first(),
        io.outputs.first(),
        io.inputs.len(),
        io.outputs.len(),
    ) else {
        return Err(bad(format!(
            "has {} inputs and {} outputs, not one of each",
            io.inputs.len(),
            io.outputs.len()
        )));
    };
    for v in [input, output] {
        if !v.is_float() || v.dims.is_empty() {
            return Err(bad(format!("tensor `{}` is not an FP32 array", v.name)));
        }
        if v.dims[1..].iter().any(Option::is_none) {
            return Err(bad(format!(
                "tensor `{}` has a free dimension besides the batch",
                v.name
            )));
        }
    }
    let batched = input.dims[0].is_none() && output.dims[0].is_none();
    Ok((input.clone(), output.clone(), batched))
}

/// The `config.pbtxt` of one model (Triton's model configuration, protobuf text format).
pub fn config_pbtxt(
    name: &str,
    input: &ValueSpec,
    output: &ValueSpec,
    max_batch_size: usize,
    opts: &ExportOptions,
) -> String {
    // With batching, `dims` leave out the batch dimension, as Triton requires.
    let skip = usize::from(max_batch_size > 0);
    let tensor = |v: &ValueSpec| {
        let dims: Vec<String> = v.dims[skip..]
            .iter()
            .map(|d| d.map_or("-1".to_string(), |d| d.to_string()))
            .collect();
        format!(
            "  {{\n    name: \"{}\"\n    data_type: TYPE_FP32\n    dims: [ {} ]\n  }}\n",
            v.name,
            dims.join(", ")
        )
    };
    let mut s = format!(
        "# Written by `hilum models export-triton` (hilum {}): the graph in 1/model.onnx, \
         Hilum's pre- and\n# postprocessing stay in Hilum (--backend kserve).\n\
         name: \"{name}\"\nplatform: \"onnxruntime_onnx\"\nmax_batch_size: {max_batch_size}\n",
        env!("CARGO_PKG_VERSION")
    );
    s += &format!("input [\n{}]\n", tensor(input));
    s += &format!("output [\n{}]\n", tensor(output));
    if max_batch_size > 0 {
        let preferred: Vec<String> = (1..)
            .map(|k| 1usize << k)
            .take_while(|&b| b <= max_batch_size)
            .map(|b| b.to_string())
            .collect();
        s += "dynamic_batching {\n";
        if !preferred.is_empty() {
            s += &format!("  preferred_batch_size: [ {} ]\n", preferred.join(", "));
        }
        s += &format!(
            "  max_queue_delay_microseconds: {}\n}}\n",
            opts.max_queue_delay_us
        );
    }
    let count = opts.instances.max(1);
    let groups: Vec<String> = if opts.gpus == 0 {
        vec![format!(
            "  {{\n    count: {count}\n    kind: KIND_CPU\n  }}"
        )]
    } else {
        (0..opts.gpus)
            .map(|g| {
                format!("  {{\n    count: {count}\n    kind: KIND_GPU\n    gpus: [ {g} ]\n  }}")
            })
            .collect()
    };
    s += &format!("instance_group [\n{}\n]\n", groups.join(",\n"));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xrv::XrvSpec;

    fn spec(name: &str, dims: &[Option<usize>]) -> ValueSpec {
        ValueSpec {
            name: name.into(),
            elem_type: 1,
            dims: dims.to_vec(),
        }
    }

    #[test]
    fn config_has_batching_and_one_group_per_gpu() {
        let x = spec("x", &[None, Some(1), Some(224), Some(224)]);
        let y = spec("logits", &[None, Some(18)]);
        let opts = ExportOptions {
            gpus: 2,
            ..Default::default()
        };
        let c = config_pbtxt("densenet121-res224-all", &x, &y, 16, &opts);
        assert!(c.contains("platform: \"onnxruntime_onnx\""), "{c}");
        assert!(c.contains("max_batch_size: 16"), "{c}");
        assert!(c.contains("dims: [ 1, 224, 224 ]"), "{c}");
        assert!(c.contains("dims: [ 18 ]"), "{c}");
        assert!(c.contains("preferred_batch_size: [ 2, 4, 8, 16 ]"), "{c}");
        assert!(
            c.contains("gpus: [ 0 ]") && c.contains("gpus: [ 1 ]"),
            "{c}"
        );
        assert_eq!(c.matches("KIND_GPU").count(), 2);
        let cpu = config_pbtxt("m", &x, &y, 0, &ExportOptions::default());
        assert!(
            cpu.contains("KIND_CPU") && !cpu.contains("dynamic_batching"),
            "{cpu}"
        );
        assert!(cpu.contains("dims: [ -1, 1, 224, 224 ]"), "{cpu}");
    }

    #[test]
    fn export_writes_the_classifier_graph_and_skips_what_has_none() {
        let dir = tempfile::tempdir().expect("tempdir");
        let registry = ModelRegistry::new(dir.path().join("models")).expect("registry");
        let w = crate::xrv::synthetic_weights(&XrvSpec::densenet121_res224_all().arch, 1)
            .expect("weights");
        let ckpt = dir.path().join("site.safetensors");
        candle_core::safetensors::save(&w, &ckpt).expect("save");
        let opts = crate::ImportOptions {
            custom: true,
            ..Default::default()
        };
        crate::import(&registry, "densenet121-res224-all", &ckpt, &opts).expect("import");
        let repo = dir.path().join("repo");
        let done = export_triton(&registry, &repo, &[], &ExportOptions::default()).expect("export");
        let written: Vec<&Exported> = done
            .iter()
            .filter(|e| matches!(e, Exported::Written { .. }))
            .collect();
        assert_eq!(written.len(), 1, "{done:?}");
        let config = std::fs::read_to_string(repo.join("densenet121-res224-all/config.pbtxt"))
            .expect("config");
        assert!(config.contains("name: \"x\"") && config.contains("name: \"logits\""));
        let graph = std::fs::read(repo.join("densenet121-res224-all/1/model.onnx")).expect("onnx");
        assert_eq!(
            graph_io(&graph).expect("io").outputs[0].dims,
            vec![None, Some(18)]
        );
        assert!(done
            .iter()
            .any(|e| matches!(e, Exported::Skipped { id, reason }
            if id == "llava-med-v1.5" && reason.contains("no ONNX graph"))));
        // The PSPNet and MedSAM's encoder have graphs: only skipped as not installed.
        for with_graph in ["chestx-det-pspnet", "medsam-vit-b"] {
            assert!(
                done.iter()
                    .any(|e| matches!(e, Exported::Skipped { id, reason }
                    if id == with_graph && reason == "not installed")),
                "{with_graph}: {done:?}"
            );
        }
        let named = export_triton(
            &registry,
            &repo,
            &["lung-unet".to_string()],
            &ExportOptions::default(),
        );
        assert!(
            matches!(named, Err(ModelError::NotInstalled { .. })),
            "{named:?}"
        );
    }
}
