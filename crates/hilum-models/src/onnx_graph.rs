//! Writes ONNX graphs (`onnx.proto`, IR version 8, opset 17) of Hilum's candle networks, so ONNX
//! Runtime runs exactly the weights the native path loaded — no PyTorch export needed, which
//! matters at sites that only have the converted safetensors.
//!
//! Only the protobuf messages and fields a CNN needs are written (ModelProto, GraphProto,
//! NodeProto, AttributeProto, TensorProto, ValueInfoProto and the type messages), with their
//! field numbers from `onnx/onnx.proto`. Initializers keep the checkpoint's parameter names
//! (`features.conv0.weight`), as `torch.onnx.export` does.

use candle_core::{DType, Result, Tensor};
use candle_nn::{BatchNorm, Conv2d, Linear};

/// Name of a classifier graph's input: (batch, channels, size, size), preprocessed pixels.
pub const INPUT: &str = "x";
/// Name of a classifier graph's output: (batch, classes) logits.
pub const OUTPUT: &str = "logits";

/// `TensorProto.DataType.FLOAT`.
const FLOAT: i64 = 1;
/// `TensorProto.DataType.INT64`.
const INT64: i64 = 7;
const IR_VERSION: i64 = 8;
const OPSET: i64 = 17;

/// Protobuf wire encoding of one message.
#[derive(Default)]
struct Pb(Vec<u8>);

impl Pb {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }
    fn key(&mut self, field: u32, wire: u8) {
        self.varint(((field as u64) << 3) | wire as u64);
    }
    fn int(&mut self, field: u32, v: i64) {
        self.key(field, 0);
        // Negative int64 values are ten-byte two's complement varints.
        self.varint(v as u64);
    }
    fn float(&mut self, field: u32, v: f32) {
        self.key(field, 5);
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, field: u32, s: &str) {
        self.bytes(field, s.as_bytes());
    }
    fn msg(&mut self, field: u32, m: &Pb) {
        self.bytes(field, &m.0);
    }
}

/// One node attribute (`AttributeProto`).
pub enum Attr {
    /// An integer attribute: name and value.
    Int(&'static str, i64),
    /// A list of integers: name and values.
    Ints(&'static str, Vec<i64>),
    /// A float attribute: name and value.
    Float(&'static str, f32),
    /// A string attribute: name and value.
    Str(&'static str, &'static str),
}

impl Attr {
    fn encode(&self) -> Pb {
        // AttributeProto: name = 1, f = 2, i = 3, ints = 8, type = 20 (FLOAT 1, INT 2, INTS 7).
        let mut a = Pb::default();
        match self {
            Attr::Int(name, v) => {
                a.str(1, name);
                a.int(3, *v);
                a.int(20, 2);
            }
            Attr::Ints(name, vs) => {
                a.str(1, name);
                for &v in vs {
                    a.int(8, v);
                }
                a.int(20, 7);
            }
            Attr::Float(name, v) => {
                a.str(1, name);
                a.float(2, *v);
                a.int(20, 1);
            }
            Attr::Str(name, v) => {
                // s = 4, type STRING = 3.
                a.str(1, name);
                a.str(4, v);
                a.int(20, 3);
            }
        }
        a
    }
}

/// A dimension of a graph input or output.
#[derive(Clone, Copy, Debug)]
pub enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// Symbolic, e.g. the batch size.
    Named(&'static str),
}

fn value_info(name: &str, dims: &[Dim]) -> Pb {
    // TensorShapeProto.Dimension: dim_value = 1, dim_param = 2.
    let mut shape = Pb::default();
    for d in dims {
        let mut dim = Pb::default();
        match d {
            Dim::Fixed(n) => dim.int(1, *n as i64),
            Dim::Named(s) => dim.str(2, s),
        }
        shape.msg(1, &dim);
    }
    // TypeProto.Tensor: elem_type = 1, shape = 2; TypeProto: tensor_type = 1.
    let mut tensor = Pb::default();
    tensor.int(1, FLOAT);
    tensor.msg(2, &shape);
    let mut ty = Pb::default();
    ty.msg(1, &tensor);
    // ValueInfoProto: name = 1, type = 2.
    let mut vi = Pb::default();
    vi.str(1, name);
    vi.msg(2, &ty);
    vi
}

/// Builds one graph node by node; each op returns the name of its output.
pub struct GraphBuilder {
    name: String,
    nodes: Vec<Pb>,
    initializers: Vec<Pb>,
    next: usize,
}

impl GraphBuilder {
    /// An empty graph named `name`.
    pub fn new(name: &str) -> Self {
        GraphBuilder {
            name: name.to_string(),
            nodes: Vec::new(),
            initializers: Vec::new(),
            next: 0,
        }
    }

    /// Adds `t` (any device, converted to f32) as the initializer `name`.
    pub fn weight(&mut self, name: &str, t: &Tensor) -> Result<String> {
        let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        self.constant(name, t.dims(), &values);
        Ok(name.to_string())
    }

    /// Adds f32 `values` of shape `dims` as the initializer `name`.
    pub fn constant(&mut self, name: &str, dims: &[usize], values: &[f32]) -> String {
        // TensorProto: dims = 1, data_type = 2, name = 8, raw_data = 9 (little-endian).
        let mut t = Pb::default();
        for &d in dims {
            t.int(1, d as i64);
        }
        t.int(2, FLOAT);
        t.str(8, name);
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        t.bytes(9, &raw);
        self.initializers.push(t);
        name.to_string()
    }

    /// Adds int64 `values` (shapes, sizes) of shape `[values.len()]` as the initializer `name`.
    pub fn constant_i64(&mut self, name: &str, values: &[i64]) -> String {
        self.constant_i64_shaped(name, &[values.len()], values)
    }

    /// Adds int64 `values` of shape `dims` (`[]`: a scalar) as the initializer `name`.
    fn constant_i64_shaped(&mut self, name: &str, dims: &[usize], values: &[i64]) -> String {
        let mut t = Pb::default();
        for &d in dims {
            t.int(1, d as i64);
        }
        t.int(2, INT64);
        t.str(8, name);
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        t.bytes(9, &raw);
        self.initializers.push(t);
        name.to_string()
    }

    /// A 1-D int64 constant (a shape, permutation or pad list) under a generated name.
    pub fn ints(&mut self, values: &[i64]) -> String {
        self.next += 1;
        let name = format!("ints_{}", self.next);
        self.constant_i64(&name, values)
    }

    /// A scalar int64 constant (an index for `Gather` that drops the axis).
    pub fn index(&mut self, value: i64) -> String {
        self.next += 1;
        let name = format!("index_{}", self.next);
        self.constant_i64_shaped(&name, &[], &[value])
    }

    /// A scalar f32 constant under a generated name.
    pub fn scalar(&mut self, value: f32) -> String {
        self.next += 1;
        let name = format!("scalar_{}", self.next);
        self.constant(&name, &[], &[value])
    }

    /// `Reshape` to `shape` (-1 once for the free batch).
    pub fn reshape(&mut self, x: &str, shape: &[i64]) -> String {
        let s = self.ints(shape);
        self.node("Reshape", &[x, &s], &[])
    }

    /// `Transpose` by the permutation `perm`.
    pub fn transpose(&mut self, x: &str, perm: &[i64]) -> String {
        self.node("Transpose", &[x], &[Attr::Ints("perm", perm.to_vec())])
    }

    /// `MatMul` of `a` by `b`.
    pub fn matmul(&mut self, a: &str, b: &str) -> String {
        self.node("MatMul", &[a, b], &[])
    }

    /// Elementwise `Mul` (broadcasting).
    pub fn mul(&mut self, a: &str, b: &str) -> String {
        self.node("Mul", &[a, b], &[])
    }

    /// Adds a node; returns its (single) output's name.
    pub fn node(&mut self, op: &str, inputs: &[&str], attrs: &[Attr]) -> String {
        self.next += 1;
        let out = format!("{}_{}", op.to_ascii_lowercase(), self.next);
        // NodeProto: input = 1, output = 2, name = 3, op_type = 4, attribute = 5.
        let mut n = Pb::default();
        for i in inputs {
            n.str(1, i);
        }
        n.str(2, &out);
        n.str(3, &format!("{op}_{}", self.next));
        n.str(4, op);
        for a in attrs {
            n.msg(5, &a.encode());
        }
        self.nodes.push(n);
        out
    }

    /// `Conv` with the layer's stride, padding, dilation and groups; `name` is the checkpoint
    /// prefix of its parameters (`features.conv0`).
    pub fn conv2d(&mut self, name: &str, conv: &Conv2d, x: &str) -> Result<String> {
        let c = conv.config();
        let (_, _, kh, kw) = conv.weight().dims4()?;
        let w = self.weight(&format!("{name}.weight"), conv.weight())?;
        let mut inputs = vec![x.to_string(), w];
        if let Some(b) = conv.bias() {
            inputs.push(self.weight(&format!("{name}.bias"), b)?);
        }
        let (p, s, d) = (c.padding as i64, c.stride as i64, c.dilation as i64);
        let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
        Ok(self.node(
            "Conv",
            &inputs,
            &[
                Attr::Ints("kernel_shape", vec![kh as i64, kw as i64]),
                Attr::Ints("pads", vec![p, p, p, p]),
                Attr::Ints("strides", vec![s, s]),
                Attr::Ints("dilations", vec![d, d]),
                Attr::Int("group", c.groups as i64),
            ],
        ))
    }

    /// Inference `BatchNormalization` with the running statistics.
    pub fn batch_norm(&mut self, name: &str, bn: &BatchNorm, x: &str) -> Result<String> {
        let c = bn.running_mean().dims1()?;
        let (scale, bias) = match bn.weight_and_bias() {
            Some((w, b)) => (
                self.weight(&format!("{name}.weight"), w)?,
                self.weight(&format!("{name}.bias"), b)?,
            ),
            None => (
                self.constant(&format!("{name}.weight"), &[c], &vec![1.0; c]),
                self.constant(&format!("{name}.bias"), &[c], &vec![0.0; c]),
            ),
        };
        let mean = self.weight(&format!("{name}.running_mean"), bn.running_mean())?;
        let var = self.weight(&format!("{name}.running_var"), bn.running_var())?;
        Ok(self.node(
            "BatchNormalization",
            &[x, &scale, &bias, &mean, &var],
            &[Attr::Float("epsilon", bn.eps() as f32)],
        ))
    }

    /// `Relu`.
    pub fn relu(&mut self, x: &str) -> String {
        self.node("Relu", &[x], &[])
    }

    /// `MaxPool` (padding counts as -inf, as in PyTorch).
    pub fn max_pool(&mut self, x: &str, kernel: usize, stride: usize, pad: usize) -> String {
        let (k, s, p) = (kernel as i64, stride as i64, pad as i64);
        self.node(
            "MaxPool",
            &[x],
            &[
                Attr::Ints("kernel_shape", vec![k, k]),
                Attr::Ints("strides", vec![s, s]),
                Attr::Ints("pads", vec![p, p, p, p]),
            ],
        )
    }

    /// `AveragePool` without padding, kernel = stride.
    pub fn avg_pool(&mut self, x: &str, kernel: usize) -> String {
        let k = kernel as i64;
        self.node(
            "AveragePool",
            &[x],
            &[
                Attr::Ints("kernel_shape", vec![k, k]),
                Attr::Ints("strides", vec![k, k]),
            ],
        )
    }

    /// Bilinear `Resize` of an NCHW tensor to `h` x `w`, sampling as PyTorch's
    /// `F.interpolate(mode="bilinear", align_corners)` does. The batch and channels are taken
    /// from `x` at run time (opset 17's `sizes` names every axis), so the batch stays free.
    pub fn resize_bilinear(&mut self, x: &str, h: usize, w: usize, align_corners: bool) -> String {
        let nc = self.node("Shape", &[x], &[Attr::Int("start", 0), Attr::Int("end", 2)]);
        let hw = format!("resize_hw_{}", self.next);
        self.constant_i64(&hw, &[h as i64, w as i64]);
        let sizes = self.concat(&[&nc, &hw], 0);
        let mode = if align_corners {
            "align_corners"
        } else {
            "pytorch_half_pixel"
        };
        self.node(
            "Resize",
            &[x, "", "", &sizes],
            &[
                Attr::Str("mode", "linear"),
                Attr::Str("coordinate_transformation_mode", mode),
            ],
        )
    }

    /// `Sigmoid`.
    pub fn sigmoid(&mut self, x: &str) -> String {
        self.node("Sigmoid", &[x], &[])
    }

    /// `Concat` of `xs` along `axis`.
    pub fn concat(&mut self, xs: &[&str], axis: i64) -> String {
        self.node("Concat", xs, &[Attr::Int("axis", axis)])
    }

    /// Elementwise `Add` (broadcasting).
    pub fn add(&mut self, a: &str, b: &str) -> String {
        self.node("Add", &[a, b], &[])
    }

    /// (b, c, h, w) → (b, c): the mean over all pixels.
    pub fn global_avg_pool(&mut self, x: &str) -> String {
        let pooled = self.node("GlobalAveragePool", &[x], &[]);
        self.node("Flatten", &[&pooled], &[Attr::Int("axis", 1)])
    }

    /// `Gemm` computing `x @ weight.T + bias`, like `candle_nn::Linear`.
    pub fn linear(&mut self, name: &str, l: &Linear, x: &str) -> Result<String> {
        let w = self.weight(&format!("{name}.weight"), l.weight())?;
        let mut inputs = vec![x.to_string(), w];
        if let Some(b) = l.bias() {
            inputs.push(self.weight(&format!("{name}.bias"), b)?);
        }
        let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
        Ok(self.node("Gemm", &inputs, &[Attr::Int("transB", 1)]))
    }

    /// The serialised `ModelProto`: graph input `input` (shape `in_dims`), graph output
    /// `output`, renamed from the value `last` with an `Identity`.
    pub fn finish(
        mut self,
        input: (&str, &[Dim]),
        last: &str,
        output: (&str, &[Dim]),
        doc: &str,
    ) -> Vec<u8> {
        // NodeProto of the Identity that names the output.
        let mut n = Pb::default();
        n.str(1, last);
        n.str(2, output.0);
        n.str(3, "output");
        n.str(4, "Identity");
        self.nodes.push(n);
        // GraphProto: node = 1, name = 2, initializer = 5, doc_string = 10, input = 11, output = 12.
        let mut g = Pb::default();
        for n in &self.nodes {
            g.msg(1, n);
        }
        g.str(2, &self.name);
        for t in &self.initializers {
            g.msg(5, t);
        }
        g.str(10, doc);
        g.msg(11, &value_info(input.0, input.1));
        g.msg(12, &value_info(output.0, output.1));
        // OperatorSetIdProto: domain = 1 (empty: the default ai.onnx), version = 2.
        let mut opset = Pb::default();
        opset.str(1, "");
        opset.int(2, OPSET);
        // ModelProto: ir_version = 1, producer_name = 2, producer_version = 3, graph = 7,
        // opset_import = 8.
        let mut m = Pb::default();
        m.int(1, IR_VERSION);
        m.str(2, "hilum");
        m.str(3, env!("CARGO_PKG_VERSION"));
        m.msg(7, &g);
        m.msg(8, &opset);
        m.0
    }
}

impl GraphBuilder {
    /// [`GraphBuilder::finish`] for an image classifier: input [`INPUT`] with a symbolic batch
    /// size, output [`OUTPUT`].
    pub fn finish_classifier(
        self,
        logits: &str,
        channels: usize,
        size: usize,
        classes: usize,
        doc: &str,
    ) -> Vec<u8> {
        let batch = Dim::Named("batch");
        self.finish(
            (
                INPUT,
                &[
                    batch,
                    Dim::Fixed(channels),
                    Dim::Fixed(size),
                    Dim::Fixed(size),
                ],
            ),
            logits,
            (OUTPUT, &[batch, Dim::Fixed(classes)]),
            doc,
        )
    }
}

/// A graph input or output as the model declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueSpec {
    /// The tensor's name.
    pub name: String,
    /// `TensorProto.DataType` (1: FLOAT).
    pub elem_type: i64,
    /// `None` for a symbolic dimension (e.g. the batch).
    pub dims: Vec<Option<usize>>,
}

impl ValueSpec {
    /// Whether the elements are 32-bit floats.
    pub fn is_float(&self) -> bool {
        self.elem_type == FLOAT
    }
}

/// The inputs (initializers excluded) and outputs of a graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphIo {
    /// The graph's inputs, in order.
    pub inputs: Vec<ValueSpec>,
    /// The graph's outputs, in order.
    pub outputs: Vec<ValueSpec>,
}

/// Reads the declared inputs and outputs of a serialised `ModelProto` (this module's graphs or
/// any other, e.g. the lung U-Net's imported `model.onnx`), skipping everything else.
pub fn graph_io(model: &[u8]) -> std::result::Result<GraphIo, String> {
    let mut graph = None;
    each_field(model, |field, v| {
        if let (7, Field::Bytes(b)) = (field, v) {
            graph = Some(b);
        }
        Ok(())
    })?;
    let graph = graph.ok_or("not an ONNX model: no graph")?;
    let (mut inputs, mut outputs, mut initializers) = (Vec::new(), Vec::new(), Vec::new());
    each_field(graph, |field, v| {
        match (field, v) {
            (5, Field::Bytes(t)) => each_field(t, |f, v| {
                if let (8, Field::Bytes(name)) = (f, v) {
                    initializers.push(String::from_utf8_lossy(name).into_owned());
                }
                Ok(())
            })?,
            (11, Field::Bytes(b)) => inputs.push(value_spec(b)?),
            (12, Field::Bytes(b)) => outputs.push(value_spec(b)?),
            _ => {}
        }
        Ok(())
    })?;
    // Before IR version 4 initializers were listed among the inputs too.
    inputs.retain(|v: &ValueSpec| !initializers.contains(&v.name));
    Ok(GraphIo { inputs, outputs })
}

/// One decoded protobuf field: a varint or fixed-width number, or length-delimited bytes.
enum Field<'a> {
    Int(u64),
    Bytes(&'a [u8]),
}

fn read_varint(b: &[u8], i: &mut usize) -> std::result::Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*i).ok_or("truncated protobuf varint")?;
        *i += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Ok(v);
        }
    }
    Err("protobuf varint longer than 10 bytes".into())
}

/// Calls `f` with each top-level field of the message `b`.
fn each_field<'a>(
    b: &'a [u8],
    mut f: impl FnMut(u32, Field<'a>) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    let mut i = 0;
    while i < b.len() {
        let key = read_varint(b, &mut i)?;
        let field = (key >> 3) as u32;
        let value = match key & 7 {
            0 => Field::Int(read_varint(b, &mut i)?),
            1 | 5 => {
                let n = if key & 7 == 1 { 8 } else { 4 };
                i += n;
                Field::Int(0)
            }
            2 => {
                let n = read_varint(b, &mut i)? as usize;
                let bytes = b
                    .get(i..i.saturating_add(n))
                    .ok_or("truncated protobuf field")?;
                i += n;
                Field::Bytes(bytes)
            }
            w => return Err(format!("unsupported protobuf wire type {w}")),
        };
        if i > b.len() {
            return Err("truncated protobuf field".into());
        }
        f(field, value)?;
    }
    Ok(())
}

/// A `ValueInfoProto`: name = 1, type = 2 (TypeProto.tensor_type = 1: elem_type = 1,
/// shape = 2 (dim = 1: dim_value = 1, dim_param = 2)).
fn value_spec(b: &[u8]) -> std::result::Result<ValueSpec, String> {
    let mut spec = ValueSpec {
        name: String::new(),
        elem_type: 0,
        dims: Vec::new(),
    };
    each_field(b, |f, v| {
        match (f, v) {
            (1, Field::Bytes(n)) => spec.name = String::from_utf8_lossy(n).into_owned(),
            (2, Field::Bytes(ty)) => each_field(ty, |f, v| {
                if let (1, Field::Bytes(tensor)) = (f, v) {
                    each_field(tensor, |f, v| {
                        match (f, v) {
                            (1, Field::Int(t)) => spec.elem_type = t as i64,
                            (2, Field::Bytes(shape)) => each_field(shape, |f, v| {
                                if let (1, Field::Bytes(dim)) = (f, v) {
                                    let mut d = None;
                                    each_field(dim, |f, v| {
                                        if let (1, Field::Int(n)) = (f, v) {
                                            // 0 is how some exporters write "unknown".
                                            d = (n > 0).then_some(n as usize);
                                        }
                                        Ok(())
                                    })?;
                                    spec.dims.push(d);
                                }
                                Ok(())
                            })?,
                            _ => {}
                        }
                        Ok(())
                    })?;
                }
                Ok(())
            })?,
            _ => {}
        }
        Ok(())
    })?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_follow_the_protobuf_wire_format() {
        let mut p = Pb::default();
        p.varint(1);
        p.varint(300);
        p.int(1, -1);
        assert_eq!(&p.0[..3], &[0x01, 0xac, 0x02]);
        // Field 1, wire type 0, then -1 as ten bytes.
        assert_eq!(p.0[3], 0x08);
        assert_eq!(p.0.len(), 3 + 1 + 10);
        assert_eq!(p.0[13], 0x01);
    }

    #[test]
    fn initializers_are_raw_little_endian_floats() {
        let mut g = GraphBuilder::new("t");
        g.constant("w", &[2], &[1.0, -2.5]);
        let t = &g.initializers[0].0;
        let raw: Vec<u8> = [1.0f32, -2.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert!(t.ends_with(&raw), "raw_data is the last field");
        // dims = [2] (field 1), data_type = FLOAT (field 2).
        assert_eq!(&t[..4], &[0x08, 0x02, 0x10, 0x01]);
    }

    #[test]
    fn graph_io_reads_back_what_finish_wrote() {
        let mut g = GraphBuilder::new("t");
        g.constant("w", &[2], &[1.0, -2.5]);
        let y = g.relu(INPUT);
        let bytes = g.finish_classifier(&y, 1, 8, 3, "test");
        let io = graph_io(&bytes).expect("parses");
        assert_eq!(io.inputs.len(), 1, "{io:?}");
        assert_eq!(io.inputs[0].name, INPUT);
        assert!(io.inputs[0].is_float());
        assert_eq!(io.inputs[0].dims, vec![None, Some(1), Some(8), Some(8)]);
        assert_eq!(io.outputs[0].name, OUTPUT);
        assert_eq!(io.outputs[0].dims, vec![None, Some(3)]);
        assert!(graph_io(&bytes[..bytes.len() / 2]).is_err());
    }
}
