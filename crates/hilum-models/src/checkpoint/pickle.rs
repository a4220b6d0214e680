//! A restricted unpickler: reads the pickle opcodes that `torch.save` writes (protocols 0-5)
//! into inert data. Python's own unpickler calls whatever callable a file names (`os.system`,
//! `builtins.eval`); this one knows a fixed allowlist of globals, maps each to a Rust value, and
//! refuses every other global or call with an error naming it. Nothing in a file ever runs.
//!
//! Objects live in an arena ([`Pickle::objs`]) and values refer to them by index, so shared and
//! self-referencing structures cost nothing to copy, cannot overflow the stack when dropped, and
//! in-place opcodes (`SETITEMS`, `BUILD`) are seen through every reference, as in Python.

use std::collections::HashMap;
use std::rc::Rc;

use super::CheckpointError;

/// Caps that keep a hostile or corrupt file from exhausting memory.
const MAX_STACK: usize = 1 << 20;
const MAX_MARKS: usize = 1 << 12;
const MAX_MEMO: usize = 1 << 22;
const MAX_OBJS: usize = 1 << 22;
/// Values held in all containers together.
const MAX_ITEMS: usize = 1 << 24;
const MAX_NDIM: usize = 32;
const MAX_PROTOCOL: u8 = 5;

/// Element types of torch storages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The typed-storage class torch names in a checkpoint (`torch.FloatStorage`).
    fn from_storage_class(name: &str) -> Option<DType> {
        Some(match name {
            "FloatStorage" => DType::F32,
            "HalfStorage" => DType::F16,
            "BFloat16Storage" => DType::BF16,
            "DoubleStorage" => DType::F64,
            "LongStorage" => DType::I64,
            "IntStorage" => DType::I32,
            "ShortStorage" => DType::I16,
            "CharStorage" => DType::I8,
            "ByteStorage" | "UntypedStorage" => DType::U8,
            "BoolStorage" => DType::Bool,
            _ => return None,
        })
    }

    /// `torch.float32` and friends, as they appear in tensor metadata.
    fn from_dtype_name(name: &str) -> Option<DType> {
        Some(match name {
            "float32" | "float" => DType::F32,
            "float16" | "half" => DType::F16,
            "bfloat16" => DType::BF16,
            "float64" | "double" => DType::F64,
            "int64" | "long" => DType::I64,
            "int32" | "int" => DType::I32,
            "int16" | "short" => DType::I16,
            "int8" => DType::I8,
            "uint8" => DType::U8,
            "bool" => DType::Bool,
            _ => return None,
        })
    }
}

/// Index of an object in [`Pickle::objs`].
pub type ObjId = usize;

/// One pickled value. Containers and records are [`Value::Obj`] references into the arena.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer wider than 64 bits, as little-endian two's complement bytes.
    Long(Rc<[u8]>),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Global(Global),
    Obj(ObjId),
}

/// An allowlisted global: what it is, and its `module.name` for messages.
#[derive(Clone, Debug, PartialEq)]
pub struct Global {
    pub kind: GlobalKind,
    pub name: Rc<str>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum GlobalKind {
    RebuildTensor,
    RebuildTensorV2,
    RebuildParameter,
    RebuildParameterWithState,
    RebuildFromTypeV2,
    OrderedDict,
    Set,
    FrozenSet,
    Reconstructor,
    Object,
    Size,
    Device,
    /// `torch.nn.backends.thnn._get_thnn_function_backend`: the `_backend` attribute of modules
    /// pickled by torch < 1.2; torch keeps it, doing nothing, to unpickle them.
    ThnnBackend,
    /// `torch.Tensor` / `torch.nn.parameter.Parameter`: only ever an argument.
    TensorClass,
    Storage(DType),
    Dtype(DType),
    /// A `torch.nn` (modules, DataParallel) / torchxrayvision / torchvision module class: instances become
    /// [`Module`] records, never objects.
    ModuleClass,
}

/// A torch storage named by a persistent id; its bytes live outside the pickle.
#[derive(Clone, Debug, PartialEq)]
pub struct Storage {
    pub dtype: DType,
    pub key: String,
    /// Legacy files only: this storage is a view `(offset, numel)` into storage `key`.
    pub view_offset: usize,
}

/// A tensor as `_rebuild_tensor_v2` describes it (offset and strides in elements).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRef {
    pub storage: Storage,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub stride: Vec<usize>,
}

/// An `nn.Module` instance as inert data: its class name and the `__dict__` BUILD gave it.
#[derive(Clone, Debug, PartialEq)]
pub struct Module {
    pub class: Rc<str>,
    pub state: Option<Value>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Obj {
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Dict),
    Set(Vec<Value>),
    Storage(Storage),
    Tensor(TensorRef),
    Module(Module),
}

/// An insertion-ordered dict; string and integer keys are unique, as in Python.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dict {
    pub entries: Vec<(Value, Value)>,
    index: HashMap<Key, usize>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Key {
    Str(Rc<str>),
    Int(i64),
}

impl Dict {
    fn insert(&mut self, k: Value, v: Value) {
        let key = match &k {
            Value::Str(s) => Some(Key::Str(s.clone())),
            Value::Int(i) => Some(Key::Int(*i)),
            _ => None,
        };
        if let Some(key) = key {
            if let Some(&i) = self.index.get(&key) {
                if let Some(e) = self.entries.get_mut(i) {
                    e.1 = v;
                }
                return;
            }
            self.index.insert(key, self.entries.len());
        }
        self.entries.push((k, v));
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index
            .get(&Key::Str(key.into()))
            .and_then(|&i| self.entries.get(i))
            .map(|e| &e.1)
    }
}

/// A parsed pickle: the arena and the value `STOP` returned.
#[derive(Debug)]
pub struct Pickle {
    pub objs: Vec<Obj>,
    pub root: Value,
}

impl Pickle {
    pub fn obj(&self, v: &Value) -> Option<&Obj> {
        match v {
            Value::Obj(id) => self.objs.get(*id),
            _ => None,
        }
    }

    pub fn dict(&self, v: &Value) -> Option<&Dict> {
        match self.obj(v) {
            Some(Obj::Dict(d)) => Some(d),
            _ => None,
        }
    }

    pub fn tensor(&self, v: &Value) -> Option<&TensorRef> {
        match self.obj(v) {
            Some(Obj::Tensor(t)) => Some(t),
            _ => None,
        }
    }

    /// A short type name, for messages (`dict`, `DenseNet`).
    pub fn type_name(&self, v: &Value) -> String {
        match v {
            Value::None => "None".into(),
            Value::Bool(_) => "bool".into(),
            Value::Int(_) | Value::Long(_) => "int".into(),
            Value::Float(_) => "float".into(),
            Value::Str(_) => "str".into(),
            Value::Bytes(_) => "bytes".into(),
            Value::Global(g) => g.name.to_string(),
            Value::Obj(_) => match self.obj(v) {
                Some(Obj::Tuple(_)) => "tuple".into(),
                Some(Obj::List(_)) => "list".into(),
                Some(Obj::Dict(_)) => "dict".into(),
                Some(Obj::Set(_)) => "set".into(),
                Some(Obj::Storage(_)) => "storage".into(),
                Some(Obj::Tensor(_)) => "tensor".into(),
                Some(Obj::Module(m)) => m.class.to_string(),
                None => "?".into(),
            },
        }
    }
}

/// Parses one pickle at the start of `data`; returns it and the bytes it took (legacy torch
/// files hold several pickles back to back).
pub fn parse(data: &[u8]) -> Result<(Pickle, usize), CheckpointError> {
    let mut m = Machine {
        data,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        objs: Vec::new(),
        items: 0,
    };
    let root = m.run()?;
    Ok((Pickle { objs: m.objs, root }, m.pos))
}

fn malformed(msg: impl Into<String>) -> CheckpointError {
    CheckpointError::Malformed(msg.into())
}

fn refused(what: &'static str, name: impl Into<String>) -> CheckpointError {
    CheckpointError::Refused {
        what,
        name: name.into(),
    }
}

fn limit(what: &str, max: usize) -> CheckpointError {
    CheckpointError::Limit(format!("more than {max} {what} in one pickle"))
}

/// Maps `module.name` to an allowlisted global, or refuses it.
fn resolve_global(module: &str, name: &str) -> Result<Global, CheckpointError> {
    let full = format!("{module}.{name}");
    let plain_ident =
        !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    let kind = match (module, name) {
        ("torch._utils", "_rebuild_tensor") => Some(GlobalKind::RebuildTensor),
        ("torch._utils", "_rebuild_tensor_v2") => Some(GlobalKind::RebuildTensorV2),
        ("torch._utils", "_rebuild_parameter") => Some(GlobalKind::RebuildParameter),
        ("torch._utils", "_rebuild_parameter_with_state") => {
            Some(GlobalKind::RebuildParameterWithState)
        }
        ("torch._tensor", "_rebuild_from_type_v2") => Some(GlobalKind::RebuildFromTypeV2),
        ("collections", "OrderedDict") => Some(GlobalKind::OrderedDict),
        ("builtins" | "__builtin__", "set") => Some(GlobalKind::Set),
        ("builtins" | "__builtin__", "frozenset") => Some(GlobalKind::FrozenSet),
        ("builtins" | "__builtin__", "object") => Some(GlobalKind::Object),
        ("copyreg" | "copy_reg", "_reconstructor") => Some(GlobalKind::Reconstructor),
        ("torch.nn.backends.thnn", "_get_thnn_function_backend") => Some(GlobalKind::ThnnBackend),
        ("torch", "Size") => Some(GlobalKind::Size),
        ("torch", "device") => Some(GlobalKind::Device),
        ("torch", "Tensor") | ("torch.nn.parameter", "Parameter") => Some(GlobalKind::TensorClass),
        ("torch" | "torch.storage", "UntypedStorage" | "_UntypedStorage") => {
            Some(GlobalKind::Storage(DType::U8))
        }
        // Pre-1.6 torch named GPU storages by their CUDA class; the bytes on disk are the same.
        ("torch.cuda", n) => DType::from_storage_class(n).map(GlobalKind::Storage),
        ("torch", n) => DType::from_storage_class(n)
            .map(GlobalKind::Storage)
            .or_else(|| DType::from_dtype_name(n).map(GlobalKind::Dtype)),
        (m, _)
            if plain_ident
                && (m.starts_with("torch.nn.modules.")
                    || m.starts_with("torch.nn.parallel.")
                    || m == "torchxrayvision"
                    || m.starts_with("torchxrayvision.")
                    || m.starts_with("torchvision.models.")) =>
        {
            Some(GlobalKind::ModuleClass)
        }
        _ => None,
    };
    // The generic typed-storage class names no dtype: inert, and refused as a storage type
    // (torch writes `torch.FloatStorage` and friends there).
    let kind = kind.or(match (module, name) {
        ("torch.storage" | "torch", "_TypedStorage" | "TypedStorage") => {
            Some(GlobalKind::TensorClass)
        }
        _ => None,
    });
    match kind {
        Some(kind) => Ok(Global {
            kind,
            name: full.into(),
        }),
        None => Err(refused("global", full)),
    }
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u64, Value>,
    objs: Vec<Obj>,
    items: usize,
}

impl<'a> Machine<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CheckpointError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| malformed(format!("pickle truncated at byte {}", self.pos)))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, CheckpointError> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N], CheckpointError> {
        let mut b = [0u8; N];
        b.copy_from_slice(self.take(N)?);
        Ok(b)
    }

    /// A length field that must fit in the rest of the file.
    fn len_u64(&mut self, n: u64) -> Result<usize, CheckpointError> {
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.data.len() - self.pos)
            .ok_or_else(|| malformed(format!("length {n} runs past the end of the pickle")))
    }

    fn line(&mut self) -> Result<&'a str, CheckpointError> {
        let rest = &self.data[self.pos..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| malformed("text opcode without a newline"))?;
        let s =
            std::str::from_utf8(&rest[..end]).map_err(|_| malformed("text opcode is not UTF-8"))?;
        self.pos += end + 1;
        Ok(s.strip_suffix('\r').unwrap_or(s))
    }

    fn push(&mut self, v: Value) -> Result<(), CheckpointError> {
        if self.stack.len() >= MAX_STACK {
            return Err(limit("stack values", MAX_STACK));
        }
        self.stack.push(v);
        Ok(())
    }

    fn pop(&mut self) -> Result<Value, CheckpointError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(malformed("stack underflow"));
        }
        self.stack.pop().ok_or_else(|| malformed("stack underflow"))
    }

    fn top_obj(&self) -> Result<ObjId, CheckpointError> {
        match self.stack.last() {
            Some(Value::Obj(id)) => Ok(*id),
            _ => Err(malformed("opcode needs a container on the stack")),
        }
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, CheckpointError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| malformed("no MARK on the stack"))?;
        if mark > self.stack.len() {
            return Err(malformed("MARK beyond the stack"));
        }
        Ok(self.stack.split_off(mark))
    }

    fn alloc(&mut self, obj: Obj) -> Result<Value, CheckpointError> {
        if self.objs.len() >= MAX_OBJS {
            return Err(limit("objects", MAX_OBJS));
        }
        self.count_items(match &obj {
            Obj::Tuple(v) | Obj::List(v) | Obj::Set(v) => v.len(),
            Obj::Dict(d) => d.entries.len(),
            _ => 1,
        })?;
        self.objs.push(obj);
        Ok(Value::Obj(self.objs.len() - 1))
    }

    fn count_items(&mut self, n: usize) -> Result<(), CheckpointError> {
        self.items = self.items.saturating_add(n);
        if self.items > MAX_ITEMS {
            return Err(limit("container items", MAX_ITEMS));
        }
        Ok(())
    }

    fn memo_put(&mut self, key: u64) -> Result<(), CheckpointError> {
        let v = self
            .stack
            .last()
            .cloned()
            .ok_or_else(|| malformed("memo store from an empty stack"))?;
        if self.memo.len() >= MAX_MEMO && !self.memo.contains_key(&key) {
            return Err(limit("memo entries", MAX_MEMO));
        }
        self.memo.insert(key, v);
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<(), CheckpointError> {
        let v = self
            .memo
            .get(&key)
            .cloned()
            .ok_or_else(|| malformed(format!("memo key {key} was never stored")))?;
        self.push(v)
    }

    fn tuple(&self, v: &Value) -> Option<&[Value]> {
        match v {
            Value::Obj(id) => match self.objs.get(*id) {
                Some(Obj::Tuple(t)) => Some(t),
                _ => None,
            },
            _ => None,
        }
    }

    fn str_value(bytes: &[u8]) -> Result<Value, CheckpointError> {
        std::str::from_utf8(bytes)
            .map(|s| Value::Str(s.into()))
            .map_err(|_| malformed("string is not UTF-8"))
    }

    /// Python 2 `str` values: text when UTF-8 (as torch.load decodes them), else bytes.
    fn py2_str(bytes: &[u8]) -> Value {
        match std::str::from_utf8(bytes) {
            Ok(s) => Value::Str(s.into()),
            Err(_) => Value::Bytes(bytes.into()),
        }
    }

    fn int_bytes(bytes: &[u8]) -> Value {
        // Little-endian two's complement; wider than 8 bytes is kept as bytes (torch's legacy
        // magic number is 80 bits).
        if bytes.len() > 8 {
            return Value::Long(bytes.into());
        }
        let neg = bytes.last().is_some_and(|b| b & 0x80 != 0);
        let mut b = [if neg { 0xff } else { 0 }; 8];
        b[..bytes.len()].copy_from_slice(bytes);
        Value::Int(i64::from_le_bytes(b))
    }

    fn run(&mut self) -> Result<Value, CheckpointError> {
        loop {
            let op = self.byte()?;
            match op {
                b'.' => {
                    let v = self
                        .stack
                        .pop()
                        .ok_or_else(|| malformed("STOP on an empty stack"))?;
                    return Ok(v);
                }
                0x80 | 0x95 | b'(' | b'0' | b'1' | b'2' => self.control(op)?,
                b'N' | 0x88 | 0x89 | b'I' | b'L' | b'F' | b'J' | b'K' | b'M' | 0x8a | 0x8b
                | b'G' => self.number(op)?,
                b'S' | b'V' | b'T' | b'U' | b'X' | 0x8c | 0x8d | b'B' | b'C' | 0x8e | 0x96 => {
                    self.string(op)?
                }
                b')'
                | b't'
                | 0x85..=0x87
                | b']'
                | b'l'
                | b'}'
                | b'd'
                | 0x8f
                | 0x91
                | b'a'
                | b'e'
                | 0x90
                | b's'
                | b'u' => self.container(op)?,
                b'p' | b'q' | b'r' | 0x94 | b'g' | b'h' | b'j' => self.memo_op(op)?,
                b'c' | 0x93 | b'R' | 0x81 | 0x92 | b'i' | b'o' | b'b' | b'Q' => self.object(op)?,
                b'P' => {
                    return Err(CheckpointError::Unsupported(
                        "text persistent ids (PERSID): not written by torch.save".into(),
                    ))
                }
                0x82..=0x84 => return Err(refused("opcode", "EXT (copyreg extension registry)")),
                0x97 | 0x98 => {
                    return Err(CheckpointError::Unsupported(
                        "out-of-band pickle buffers".into(),
                    ))
                }
                _ => return Err(self.unknown(op)),
            }
        }
    }

    fn unknown(&self, op: u8) -> CheckpointError {
        malformed(format!(
            "unknown pickle opcode 0x{op:02x} at byte {}",
            self.pos - 1
        ))
    }

    /// PROTO, FRAME, MARK, POP, POP_MARK, DUP: the stack and the stream.
    fn control(&mut self, op: u8) -> Result<(), CheckpointError> {
        match op {
            0x80 => {
                let p = self.byte()?;
                if p > MAX_PROTOCOL {
                    return Err(CheckpointError::Unsupported(format!("pickle protocol {p}")));
                }
            }
            0x95 => {
                self.take(8)?;
            }
            b'(' => {
                if self.marks.len() >= MAX_MARKS {
                    return Err(limit("nested MARKs", MAX_MARKS));
                }
                self.marks.push(self.stack.len());
            }
            b'0' => {
                let floor = self.marks.last().copied().unwrap_or(0);
                if self.stack.len() > floor {
                    self.stack.pop();
                } else {
                    self.pop_mark()?;
                }
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let v = self
                    .stack
                    .last()
                    .cloned()
                    .ok_or_else(|| malformed("DUP on an empty stack"))?;
                self.push(v)?;
            }
            _ => return Err(self.unknown(op)),
        }
        Ok(())
    }

    /// Constants and numbers.
    fn number(&mut self, op: u8) -> Result<(), CheckpointError> {
        match op {
            b'N' => self.push(Value::None)?,
            0x88 => self.push(Value::Bool(true))?,
            0x89 => self.push(Value::Bool(false))?,
            b'I' => {
                let l = self.line()?;
                let v = match l {
                    "01" => Value::Bool(true),
                    "00" => Value::Bool(false),
                    _ => Value::Int(l.parse().map_err(|_| malformed(format!("bad INT `{l}`")))?),
                };
                self.push(v)?;
            }
            b'L' => {
                let l = self.line()?;
                let l = l.strip_suffix('L').unwrap_or(l);
                let v = l
                    .parse()
                    .map_err(|_| malformed(format!("bad LONG `{l}`")))?;
                self.push(Value::Int(v))?;
            }
            b'F' => {
                let l = self.line()?;
                let v = l
                    .parse()
                    .map_err(|_| malformed(format!("bad FLOAT `{l}`")))?;
                self.push(Value::Float(v))?;
            }
            b'J' => {
                let v = i32::from_le_bytes(self.le()?);
                self.push(Value::Int(v.into()))?;
            }
            b'K' => {
                let v = self.byte()?;
                self.push(Value::Int(v.into()))?;
            }
            b'M' => {
                let v = u16::from_le_bytes(self.le()?);
                self.push(Value::Int(v.into()))?;
            }
            0x8a => {
                let n = self.byte()? as usize;
                let b = self.take(n)?;
                self.push(Self::int_bytes(b))?;
            }
            0x8b => {
                let n = i32::from_le_bytes(self.le()?);
                let n = usize::try_from(n).map_err(|_| malformed("negative LONG4 size"))?;
                let b = self.take(n)?;
                self.push(Self::int_bytes(b))?;
            }
            b'G' => {
                let v = f64::from_be_bytes(self.le()?);
                self.push(Value::Float(v))?;
            }
            _ => return Err(self.unknown(op)),
        }
        Ok(())
    }

    /// Strings and bytes.
    fn string(&mut self, op: u8) -> Result<(), CheckpointError> {
        match op {
            b'S' => {
                let l = self.line()?;
                let v = Self::py2_str(&unquote(l)?);
                self.push(v)?;
            }
            b'V' => {
                let l = self.line()?;
                self.push(Value::Str(unescape_unicode(l)?.into()))?;
            }
            b'T' => {
                let n = i32::from_le_bytes(self.le()?);
                let n = usize::try_from(n).map_err(|_| malformed("negative BINSTRING size"))?;
                let b = self.take(n)?;
                self.push(Self::py2_str(b))?;
            }
            b'U' => {
                let n = self.byte()? as usize;
                let b = self.take(n)?;
                self.push(Self::py2_str(b))?;
            }
            b'X' => {
                let n = u32::from_le_bytes(self.le()?);
                let n = self.len_u64(n.into())?;
                let b = self.take(n)?;
                self.push(Self::str_value(b)?)?;
            }
            0x8c => {
                let n = self.byte()? as usize;
                let b = self.take(n)?;
                self.push(Self::str_value(b)?)?;
            }
            0x8d => {
                let n = u64::from_le_bytes(self.le()?);
                let n = self.len_u64(n)?;
                let b = self.take(n)?;
                self.push(Self::str_value(b)?)?;
            }
            b'B' => {
                let n = u32::from_le_bytes(self.le()?);
                let n = self.len_u64(n.into())?;
                let b = self.take(n)?;
                self.push(Value::Bytes(b.into()))?;
            }
            b'C' => {
                let n = self.byte()? as usize;
                let b = self.take(n)?;
                self.push(Value::Bytes(b.into()))?;
            }
            0x8e | 0x96 => {
                let n = u64::from_le_bytes(self.le()?);
                let n = self.len_u64(n)?;
                let b = self.take(n)?;
                self.push(Value::Bytes(b.into()))?;
            }
            _ => return Err(self.unknown(op)),
        }
        Ok(())
    }

    /// Tuples, lists, dicts and sets, and filling them.
    fn container(&mut self, op: u8) -> Result<(), CheckpointError> {
        match op {
            b')' => {
                let v = self.alloc(Obj::Tuple(Vec::new()))?;
                self.push(v)?;
            }
            b't' => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::Tuple(items))?;
                self.push(v)?;
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop()?);
                }
                items.reverse();
                let v = self.alloc(Obj::Tuple(items))?;
                self.push(v)?;
            }
            b']' => {
                let v = self.alloc(Obj::List(Vec::new()))?;
                self.push(v)?;
            }
            b'l' => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::List(items))?;
                self.push(v)?;
            }
            b'}' => {
                let v = self.alloc(Obj::Dict(Dict::default()))?;
                self.push(v)?;
            }
            b'd' => {
                let items = self.pop_mark()?;
                let d = pairs(items)?;
                let v = self.alloc(Obj::Dict(d))?;
                self.push(v)?;
            }
            0x8f => {
                let v = self.alloc(Obj::Set(Vec::new()))?;
                self.push(v)?;
            }
            0x91 => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::Set(items))?;
                self.push(v)?;
            }
            b'a' => {
                let v = self.pop()?;
                self.extend_top(vec![v])?;
            }
            b'e' | 0x90 => {
                let items = self.pop_mark()?;
                self.extend_top(items)?;
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.set_items(vec![k, v])?;
            }
            b'u' => {
                let items = self.pop_mark()?;
                self.set_items(items)?;
            }
            _ => return Err(self.unknown(op)),
        }
        Ok(())
    }

    /// The memo: PUT and GET.
    fn memo_op(&mut self, op: u8) -> Result<(), CheckpointError> {
        match op {
            b'p' => {
                let l = self.line()?;
                let k = l.parse().map_err(|_| malformed(format!("bad PUT `{l}`")))?;
                self.memo_put(k)?;
            }
            b'q' => {
                let k = self.byte()?;
                self.memo_put(k.into())?;
            }
            b'r' => {
                let k = u32::from_le_bytes(self.le()?);
                self.memo_put(k.into())?;
            }
            0x94 => {
                let k = self.memo.len() as u64;
                self.memo_put(k)?;
            }
            b'g' => {
                let l = self.line()?;
                let k = l.parse().map_err(|_| malformed(format!("bad GET `{l}`")))?;
                self.memo_get(k)?;
            }
            b'h' => {
                let k = self.byte()?;
                self.memo_get(k.into())?;
            }
            b'j' => {
                let k = u32::from_le_bytes(self.le()?);
                self.memo_get(k.into())?;
            }
            _ => return Err(self.unknown(op)),
        }
        Ok(())
    }

    /// Globals and calls: only the allowlist, only as inert values.
    fn object(&mut self, op: u8) -> Result<(), CheckpointError> {
        match op {
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                let g = resolve_global(module, name)?;
                self.push(Value::Global(g))?;
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (Value::Str(module), Value::Str(name)) = (module, name) else {
                    return Err(malformed("STACK_GLOBAL needs two strings"));
                };
                let g = resolve_global(&module, &name)?;
                self.push(Value::Global(g))?;
            }
            b'R' => {
                let args = self.pop()?;
                let func = self.pop()?;
                let v = self.call(&func, &args, true)?;
                self.push(v)?;
            }
            0x81 => {
                let _args = self.pop()?;
                let cls = self.pop()?;
                let v = self.new_object(&cls, "NEWOBJ")?;
                self.push(v)?;
            }
            0x92 => {
                let _kwargs = self.pop()?;
                let _args = self.pop()?;
                let cls = self.pop()?;
                let v = self.new_object(&cls, "NEWOBJ_EX")?;
                self.push(v)?;
            }
            b'i' => {
                let module = self.line()?;
                let name = self.line()?;
                let g = resolve_global(module, name)?;
                self.pop_mark()?;
                let v = self.new_object(&Value::Global(g), "INST")?;
                self.push(v)?;
            }
            b'o' => {
                let items = self.pop_mark()?;
                let cls = items
                    .first()
                    .cloned()
                    .ok_or_else(|| malformed("OBJ without a class"))?;
                let v = self.new_object(&cls, "OBJ")?;
                self.push(v)?;
            }
            b'b' => {
                let state = self.pop()?;
                let target = self
                    .stack
                    .last()
                    .cloned()
                    .ok_or_else(|| malformed("BUILD on an empty stack"))?;
                self.build(&target, state)?;
            }
            b'Q' => {
                let pid = self.pop()?;
                let v = self.persistent_load(&pid)?;
                self.push(v)?;
            }
            _ => return Err(self.unknown(op)),
        }
        Ok(())
    }

    fn extend_top(&mut self, items: Vec<Value>) -> Result<(), CheckpointError> {
        let id = self.top_obj()?;
        self.count_items(items.len())?;
        match self.objs.get_mut(id) {
            Some(Obj::List(l)) | Some(Obj::Set(l)) => {
                l.extend(items);
                Ok(())
            }
            _ => Err(malformed("APPEND to something that is not a list or set")),
        }
    }

    fn set_items(&mut self, items: Vec<Value>) -> Result<(), CheckpointError> {
        if !items.len().is_multiple_of(2) {
            return Err(malformed("SETITEMS with an odd number of values"));
        }
        let id = self.top_obj()?;
        self.count_items(items.len() / 2)?;
        let Some(Obj::Dict(d)) = self.objs.get_mut(id) else {
            return Err(malformed("SETITEM on something that is not a dict"));
        };
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            d.insert(k, v);
        }
        Ok(())
    }

    /// `cls.__new__(cls)` for NEWOBJ and friends: only module classes, as inert records.
    fn new_object(&mut self, cls: &Value, op: &'static str) -> Result<Value, CheckpointError> {
        match cls {
            Value::Global(g) if g.kind == GlobalKind::ModuleClass => {
                self.alloc(Obj::Module(Module {
                    class: g.name.clone(),
                    state: None,
                }))
            }
            Value::Global(g) => Err(refused(op, g.name.to_string())),
            _ => Err(malformed(format!("{op} of a non-class"))),
        }
    }

    /// REDUCE: `func(*args)`, for the allowlisted functions only, each mapped to data.
    fn call(&mut self, func: &Value, args: &Value, top: bool) -> Result<Value, CheckpointError> {
        let Value::Global(g) = func else {
            return Err(refused(
                "call of",
                "a value that is not an allowlisted global",
            ));
        };
        let args: Vec<Value> = self
            .tuple(args)
            .ok_or_else(|| malformed(format!("arguments to {} are not a tuple", g.name)))?
            .to_vec();
        let bad = |what: &str| malformed(format!("{} called with {what}", g.name));
        match &g.kind {
            GlobalKind::RebuildTensor | GlobalKind::RebuildTensorV2 => {
                if args.len() < 4 {
                    return Err(bad("too few arguments"));
                }
                let storage = match self.obj(&args[0]) {
                    Some(Obj::Storage(s)) => s.clone(),
                    _ => return Err(bad("no storage")),
                };
                let offset = as_usize(&args[1]).ok_or_else(|| bad("a bad offset"))?;
                let shape = self.usizes(&args[2]).ok_or_else(|| bad("a bad size"))?;
                let stride = self.usizes(&args[3]).ok_or_else(|| bad("bad strides"))?;
                if shape.len() != stride.len() || shape.len() > MAX_NDIM {
                    return Err(bad("sizes and strides that do not match"));
                }
                let offset = offset
                    .checked_add(storage.view_offset)
                    .ok_or_else(|| bad("a bad offset"))?;
                self.alloc(Obj::Tensor(TensorRef {
                    storage: Storage {
                        view_offset: 0,
                        ..storage
                    },
                    offset,
                    shape,
                    stride,
                }))
            }
            GlobalKind::RebuildParameter | GlobalKind::RebuildParameterWithState => {
                let data = args.first().ok_or_else(|| bad("no data"))?;
                match self.obj(data) {
                    Some(Obj::Tensor(_)) => Ok(data.clone()),
                    _ => Err(bad("data that is not a tensor")),
                }
            }
            GlobalKind::RebuildFromTypeV2 if top => {
                // (func, type, args, state): a tensor subclass or a tensor with attributes.
                let [inner, ty, inner_args, ..] = args.as_slice() else {
                    return Err(bad("too few arguments"));
                };
                match ty {
                    Value::Global(t) if t.kind == GlobalKind::TensorClass => {}
                    Value::Global(t) => return Err(refused("tensor type", t.name.to_string())),
                    _ => return Err(bad("a type that is not a class")),
                }
                self.call(inner, inner_args, false)
            }
            GlobalKind::OrderedDict => match args.as_slice() {
                [] => self.alloc(Obj::Dict(Dict::default())),
                [items] => {
                    let flat = self.pair_items(items).ok_or_else(|| bad("bad items"))?;
                    let d = pairs(flat)?;
                    self.alloc(Obj::Dict(d))
                }
                _ => Err(bad("too many arguments")),
            },
            GlobalKind::Set | GlobalKind::FrozenSet => match args.as_slice() {
                [] => self.alloc(Obj::Set(Vec::new())),
                [items] => {
                    let items = self.sequence(items).ok_or_else(|| bad("bad items"))?;
                    self.alloc(Obj::Set(items))
                }
                _ => Err(bad("too many arguments")),
            },
            GlobalKind::Size => match args.as_slice() {
                [items] => {
                    let items = self.sequence(items).ok_or_else(|| bad("bad items"))?;
                    self.alloc(Obj::Tuple(items))
                }
                _ => Err(bad("bad arguments")),
            },
            GlobalKind::Device => match args.as_slice() {
                [Value::Str(s)] => Ok(Value::Str(s.clone())),
                [Value::Str(s), Value::Int(i)] => Ok(Value::Str(format!("{s}:{i}").into())),
                _ => Err(bad("bad arguments")),
            },
            GlobalKind::ThnnBackend if args.is_empty() => Ok(Value::None),
            GlobalKind::Reconstructor => match args.as_slice() {
                [cls, Value::Global(base), _] if base.kind == GlobalKind::Object => {
                    self.new_object(cls, "copyreg._reconstructor")
                }
                _ => Err(bad("bad arguments")),
            },
            _ => Err(refused("call of", g.name.to_string())),
        }
    }

    fn obj(&self, v: &Value) -> Option<&Obj> {
        match v {
            Value::Obj(id) => self.objs.get(*id),
            _ => None,
        }
    }

    fn sequence(&self, v: &Value) -> Option<Vec<Value>> {
        match self.obj(v) {
            Some(Obj::Tuple(t)) | Some(Obj::List(t)) => Some(t.clone()),
            _ => None,
        }
    }

    /// `[(k, v), ...]` flattened to `[k, v, ...]`.
    fn pair_items(&self, v: &Value) -> Option<Vec<Value>> {
        let mut out = Vec::new();
        for p in self.sequence(v)? {
            match self.obj(&p) {
                Some(Obj::Tuple(kv)) | Some(Obj::List(kv)) if kv.len() == 2 => {
                    out.extend(kv.iter().cloned())
                }
                _ => return None,
            }
        }
        Some(out)
    }

    fn usizes(&self, v: &Value) -> Option<Vec<usize>> {
        self.sequence(v)?.iter().map(as_usize).collect()
    }

    /// BUILD: a module record keeps its state as data; nothing else has a `__setstate__` we
    /// would honour, and nothing is called.
    fn build(&mut self, target: &Value, state: Value) -> Result<(), CheckpointError> {
        let Value::Obj(id) = target else {
            return Err(malformed("BUILD on a value that is not an object"));
        };
        // (dict, slots) form from objects with __slots__: keep the dict.
        let state = match self.obj(&state) {
            Some(Obj::Tuple(t)) if t.len() == 2 => t[0].clone(),
            _ => state,
        };
        match self.objs.get_mut(*id) {
            Some(Obj::Module(m)) => {
                m.state = Some(state);
                Ok(())
            }
            // OrderedDict `_metadata`, tensor attributes: data we do not need.
            Some(Obj::Dict(_) | Obj::Tensor(_) | Obj::List(_) | Obj::Set(_)) => Ok(()),
            _ => Err(malformed("BUILD on an object that takes no state")),
        }
    }

    /// BINPERSID: torch's `('storage', StorageClass, key, location, numel[, view])`, or in
    /// legacy files `('module', ModuleClass, source_file, source)`.
    fn persistent_load(&mut self, pid: &Value) -> Result<Value, CheckpointError> {
        let t = self
            .tuple(pid)
            .ok_or_else(|| malformed("persistent id is not a tuple"))?
            .to_vec();
        let tag = match t.first() {
            Some(Value::Str(s)) => s.to_string(),
            Some(Value::Bytes(b)) => String::from_utf8_lossy(b).into_owned(),
            _ => String::new(),
        };
        // Legacy files name each module class with its source code, which is never used.
        if tag == "module" {
            return match t.get(1) {
                Some(Value::Global(g)) if g.kind == GlobalKind::ModuleClass => {
                    Ok(Value::Global(g.clone()))
                }
                Some(Value::Global(g)) => Err(refused("module class", g.name.to_string())),
                _ => Err(malformed("module persistent id without a class")),
            };
        }
        if tag != "storage" || t.len() < 5 {
            return Err(refused("persistent id", format!("`{tag}`")));
        }
        let dtype = match &t[1] {
            Value::Global(Global {
                kind: GlobalKind::Storage(d),
                ..
            }) => *d,
            Value::Global(Global {
                kind: GlobalKind::Dtype(d),
                ..
            }) => *d,
            _ => {
                return Err(malformed(
                    "persistent id without a storage class of known dtype",
                ))
            }
        };
        let key = key_string(&t[2]).ok_or_else(|| malformed("bad storage key"))?;
        // Legacy storage views: (view_key, offset, numel) into the root storage `key`.
        let view_offset = match t.get(5) {
            None | Some(Value::None) => 0,
            Some(view) => self
                .sequence(view)
                .and_then(|v| v.get(1).and_then(as_usize))
                .ok_or_else(|| malformed("bad storage view"))?,
        };
        self.alloc(Obj::Storage(Storage {
            dtype,
            key,
            view_offset,
        }))
    }
}

fn key_string(v: &Value) -> Option<String> {
    match v {
        Value::Str(s) => Some(s.to_string()),
        Value::Int(i) => Some(i.to_string()),
        Value::Bytes(b) => std::str::from_utf8(b).ok().map(str::to_string),
        _ => None,
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    match v {
        Value::Int(i) => usize::try_from(*i).ok(),
        _ => None,
    }
}

fn pairs(items: Vec<Value>) -> Result<Dict, CheckpointError> {
    if !items.len().is_multiple_of(2) {
        return Err(malformed("dict with an odd number of values"));
    }
    let mut d = Dict::default();
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        d.insert(k, v);
    }
    Ok(d)
}

/// Python 2 `repr` of a str, as protocol 0's STRING writes it.
fn unquote(l: &str) -> Result<Vec<u8>, CheckpointError> {
    let b = l.as_bytes();
    let inner = match b {
        [q @ (b'\'' | b'"'), rest @ .., last] if last == q => rest,
        _ => return Err(malformed("STRING without quotes")),
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut i = 0;
    while i < inner.len() {
        let c = inner[i];
        if c != b'\\' {
            out.push(c);
            i += 1;
            continue;
        }
        let e = *inner
            .get(i + 1)
            .ok_or_else(|| malformed("STRING ends in a backslash"))?;
        i += 2;
        match e {
            b'n' => out.push(b'\n'),
            b't' => out.push(b'\t'),
            b'r' => out.push(b'\r'),
            b'\\' | b'\'' | b'"' => out.push(e),
            b'x' => {
                let h = inner
                    .get(i..i + 2)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| malformed("bad \\x escape in STRING"))?;
                out.push(h);
                i += 2;
            }
            _ => {
                out.push(b'\\');
                out.push(e);
            }
        }
    }
    Ok(out)
}

/// Protocol 0's UNICODE: raw-unicode-escape (`\uXXXX`, `\UXXXXXXXX`).
fn unescape_unicode(l: &str) -> Result<String, CheckpointError> {
    let mut out = String::with_capacity(l.len());
    let mut chars = l.chars().peekable();
    while let Some(c) = chars.next() {
        let width = match (c, chars.peek()) {
            ('\\', Some('u')) => 4,
            ('\\', Some('U')) => 8,
            _ => {
                out.push(c);
                continue;
            }
        };
        chars.next();
        let hex: String = chars.by_ref().take(width).collect();
        let ch = u32::from_str_radix(&hex, 16)
            .ok()
            .filter(|_| hex.len() == width)
            .and_then(char::from_u32)
            .ok_or_else(|| malformed("bad \\u escape in UNICODE"))?;
        out.push(ch);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn global(module: &str, name: &str) -> Vec<u8> {
        format!("c{module}\n{name}\n").into_bytes()
    }

    fn refused_name(data: &[u8]) -> String {
        match parse(data) {
            Err(CheckpointError::Refused { name, .. }) => name,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn unknown_globals_are_refused_by_name() {
        for (m, n) in [
            ("os", "system"),
            ("posix", "system"),
            ("builtins", "eval"),
            ("builtins", "getattr"),
            ("subprocess", "Popen"),
            ("torch", "load"),
            ("torch.nn.modules", "x.y"),
            ("torchxrayvision.evil", "a b"),
        ] {
            let mut p = vec![0x80, 2];
            p.extend(global(m, n));
            p.push(b'.');
            assert_eq!(refused_name(&p), format!("{m}.{n}"));
        }
        // STACK_GLOBAL too.
        let mut p = vec![0x80, 4, 0x8c, 2];
        p.extend(b"os");
        p.extend([0x8c, 6]);
        p.extend(b"system");
        p.extend([0x93, b'.']);
        assert_eq!(refused_name(&p), "os.system");
    }

    #[test]
    fn allowlisted_globals_that_are_not_calls_are_refused_as_calls() {
        // torch.FloatStorage(...) would construct a storage from arguments: refused.
        let mut p = global("torch", "FloatStorage");
        p.extend(b")R.");
        assert_eq!(refused_name(&p), "torch.FloatStorage");
        // A module class called (instead of NEWOBJ'd) would run its __init__.
        let mut p = global("torch.nn.modules.linear", "Linear");
        p.extend(b")R.");
        assert_eq!(refused_name(&p), "torch.nn.modules.linear.Linear");
        // NEWOBJ of something that is not a module class.
        let mut p = vec![0x80, 2];
        p.extend(global("collections", "OrderedDict"));
        p.extend([b')', 0x81, b'.']);
        assert_eq!(refused_name(&p), "collections.OrderedDict");
        // REDUCE of a plain value.
        assert!(matches!(
            parse(b"K\x01)R."),
            Err(CheckpointError::Refused { .. })
        ));
    }

    #[test]
    fn a_reduce_nested_in_allowlisted_calls_is_refused() {
        // OrderedDict([("w", eval("1"))])
        let mut p = vec![0x80, 2];
        p.extend(global("collections", "OrderedDict"));
        p.extend(b"((U\x01w");
        p.extend(global("builtins", "eval"));
        p.extend(b"U\x011\x85Rtl\x85R.");
        assert_eq!(refused_name(&p), "builtins.eval");
    }

    #[test]
    fn storages_of_unknown_dtype_are_refused() {
        for (m, n) in [("torch.storage", "_TypedStorage"), ("torch", "FooStorage")] {
            let mut p = b"(U\x07storage".to_vec();
            p.extend(global(m, n));
            p.extend(b"U\x010U\x03cpuK\x04tQ.");
            assert!(parse(&p).is_err(), "{m}.{n}");
        }
    }

    #[test]
    fn cuda_storages_of_old_files_read_as_cpu_storages() {
        let mut p = b"(U\x07storage".to_vec();
        p.extend(global("torch.cuda", "HalfStorage"));
        p.extend(b"U\x0294U\x06cuda:0K\x04tQ.");
        let (pk, _) = parse(&p).expect("parses");
        let Some(Obj::Storage(st)) = pk.obj(&pk.root) else {
            panic!("{:?}", pk.root)
        };
        assert_eq!((st.dtype, st.key.as_str()), (DType::F16, "94"));
    }

    #[test]
    fn module_records_keep_their_state_as_data() {
        let mut p = vec![0x80, 2];
        p.extend(global("torch.nn.modules.linear", "Linear"));
        p.extend(b")\x81q\x00}(U\x08trainingI01\nubh\x00.");
        let (pk, _) = parse(&p).expect("parses");
        let Some(Obj::Module(m)) = pk.obj(&pk.root) else {
            panic!("{:?}", pk.root)
        };
        assert_eq!(&*m.class, "torch.nn.modules.linear.Linear");
        // Old modules' `_backend` is a call of torch's do-nothing THNN hook.
        let mut p = global("torch.nn.backends.thnn", "_get_thnn_function_backend");
        p.extend(b")R.");
        assert_eq!(parse(&p).expect("parses").0.root, Value::None);
        let state = m.state.as_ref().and_then(|s| pk.dict(s)).expect("state");
        assert_eq!(state.get("training"), Some(&Value::Bool(true)));
    }

    #[test]
    fn deep_and_self_referencing_structures_do_not_overflow() {
        // 200k nested lists: no recursion while building or dropping.
        let n = 200_000;
        let mut p = vec![b']'; n];
        p.extend(std::iter::repeat_n(b'a', n - 1));
        p.push(b'.');
        let (pk, _) = parse(&p).expect("parses");
        assert_eq!(pk.type_name(&pk.root), "list");
        // A list that contains itself.
        let (pk, _) = parse(b"]q\x00h\x00a.").expect("parses");
        let Some(Obj::List(items)) = pk.obj(&pk.root) else {
            panic!()
        };
        assert_eq!(items[0], pk.root);
    }

    #[test]
    fn limits_end_with_clear_errors() {
        let marks = vec![b'('; MAX_MARKS + 1];
        assert!(matches!(parse(&marks), Err(CheckpointError::Limit(_))));
        let nones = vec![b'N'; MAX_STACK + 1];
        assert!(matches!(parse(&nones), Err(CheckpointError::Limit(_))));
    }

    #[test]
    fn numbers_strings_and_dicts_decode_as_python_does() {
        // LONG1 -2, BININT2 513, BINFLOAT 1.5, protocol 0 INT and STRING, LONG1 wider than i64.
        let (pk, _) = parse(b"(\x8a\x01\xfeM\x01\x02G?\xf8\x00\x00\x00\x00\x00\x00I42\nS'a\\'b'\n\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01t.")
            .expect("parses");
        let Some(Obj::Tuple(t)) = pk.obj(&pk.root) else {
            panic!()
        };
        assert_eq!(t[0], Value::Int(-2));
        assert_eq!(t[1], Value::Int(513));
        assert_eq!(t[2], Value::Float(1.5));
        assert_eq!(t[3], Value::Int(42));
        assert_eq!(t[4], Value::Str("a'b".into()));
        assert!(matches!(t[5], Value::Long(_)));
        // A repeated key keeps its place and takes the last value.
        let (pk, _) = parse(b"}(U\x01aK\x01U\x01bK\x02U\x01aK\x03u.").expect("parses");
        let d = pk.dict(&pk.root).expect("dict");
        assert_eq!(d.entries.len(), 2);
        assert_eq!(d.get("a"), Some(&Value::Int(3)));
    }

    #[test]
    fn every_truncation_and_byte_flip_fails_without_panicking() {
        let mut p = vec![0x80, 2];
        p.extend(global("collections", "OrderedDict"));
        p.extend(b")R(U\x01w");
        p.extend(global("torch._utils", "_rebuild_tensor_v2"));
        p.extend(b"((U\x07storage");
        p.extend(global("torch", "FloatStorage"));
        p.extend(b"U\x010U\x03cpuK\x04tQK\x00K\x02K\x02\x86K\x02K\x01\x86\x89");
        p.extend(global("collections", "OrderedDict"));
        p.extend(b")RtRu.");
        let (pk, _) = parse(&p).expect("the intact pickle parses");
        let d = pk.dict(&pk.root).expect("dict");
        let t = pk.tensor(d.get("w").expect("w")).expect("tensor");
        assert_eq!(
            (t.shape.clone(), t.stride.clone()),
            (vec![2, 2], vec![2, 1])
        );
        for cut in 0..p.len() {
            assert!(parse(&p[..cut]).is_err(), "prefix of {cut} bytes parsed");
        }
        for i in 0..p.len() {
            for b in [0u8, 0x7f, 0x80, 0xff, b'R', b'.', b'(', b'h'] {
                let mut q = p.clone();
                q[i] = b;
                let _ = parse(&q);
            }
        }
    }
}
