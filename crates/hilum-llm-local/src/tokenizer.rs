//! The tokenizer of a GGUF file, built from its own vocabulary (byte-level BPE with its merges,
//! or SentencePiece with its scores: see `spm`), plus the token trie llguidance needs to
//! constrain sampling.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::spm::{self, SpmVocab, TYPE_CONTROL, TYPE_UNKNOWN, TYPE_UNUSED, TYPE_USER_DEFINED};
use crate::LocalError;

/// How text becomes ids: a byte-level BPE (`gpt2`-type vocabularies: Qwen, Llama 3) or a
/// SentencePiece vocabulary (`llama`-type: Gemma).
enum Encoder {
    Bpe(Box<tokenizers::Tokenizer>),
    Spm(Box<SpmVocab>),
}

impl Encoder {
    fn encode(&self, text: &str) -> Result<Vec<u32>, LocalError> {
        match self {
            Encoder::Bpe(hf) => hf
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| LocalError::Tokenizer(e.to_string())),
            Encoder::Spm(v) => v.encode(text),
        }
    }
}

/// The tokenizer a GGUF carries (byte-level BPE or SentencePiece), with its special tokens.
pub struct GgufTokenizer {
    encoder: Encoder,
    /// Raw bytes of each token (special tokens: their text).
    bytes: Vec<Vec<u8>>,
    special: HashMap<String, u32>,
    is_special: Vec<bool>,
    /// End-of-sequence token (`tokenizer.ggml.eos_token_id`).
    pub eos: u32,
    /// Beginning-of-sequence token, if the GGUF names one.
    pub bos: Option<u32>,
    /// Whether prompts start with `bos` (`tokenizer.ggml.add_bos_token`; SentencePiece default: yes).
    pub add_bos: bool,
    /// End-of-turn tokens that end generation (eos, `<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`,
    /// `<end_of_turn>`).
    pub stop_tokens: Vec<u32>,
    trie: Arc<TokTrie>,
    prose_bans: std::sync::OnceLock<(Vec<u32>, Vec<u32>)>,
}

/// The GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes
/// were shifted to U+0100.. in order. Returns the inverse map (char -> byte).
fn byte_decoder() -> HashMap<char, u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut map = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0u32..256 {
        let c = if printable(b) {
            b
        } else {
            shifted += 1;
            255 + shifted
        };
        if let Some(c) = char::from_u32(c) {
            map.insert(c, b as u8);
        }
    }
    map
}

fn metadata_ints(ct: &gguf_file::Content, key: &str) -> Vec<i64> {
    let Some(v) = ct.metadata.get(key).and_then(|v| v.to_vec().ok()) else {
        return Vec::new();
    };
    v.iter()
        .map(|x| {
            x.to_i32()
                .map(i64::from)
                .or_else(|_| x.to_u32().map(i64::from))
                .unwrap_or(1)
        })
        .collect()
}

impl GgufTokenizer {
    /// Reads only the metadata of a GGUF file (fast: no weights).
    pub fn from_file(path: &std::path::Path) -> Result<Self, LocalError> {
        let (ct, _) = crate::model::open_gguf(path)?;
        Self::from_gguf(&ct)
    }

    /// Reads the tokenizer from a GGUF's metadata.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self, LocalError> {
        let tokens: Vec<String> = ct
            .metadata
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.to_vec().ok())
            .map(|v| {
                v.iter()
                    .map(|t| t.to_string().cloned().unwrap_or_default())
                    .collect()
            })
            .unwrap_or_default();
        if tokens.is_empty() {
            return Err(LocalError::Unsupported(
                "the GGUF has no tokenizer.ggml.tokens".into(),
            ));
        }
        let types = metadata_ints(ct, "tokenizer.ggml.token_type");
        let ty = |i: usize| types.get(i).copied().unwrap_or(1);
        let id = |k: &str| {
            ct.metadata.get(k).and_then(|v| {
                v.to_u32()
                    .ok()
                    .or_else(|| v.to_i32().ok().map(|x| x as u32))
            })
        };
        let flag = |k: &str| ct.metadata.get(k).and_then(|v| v.to_bool().ok());
        let model = ct
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
            .unwrap_or("gpt2");
        let mut bytes = Vec::with_capacity(tokens.len());
        let mut special = HashMap::new();
        let mut is_special = Vec::with_capacity(tokens.len());
        let (encoder, add_bos) = match model {
            "gpt2" => {
                let hf = tokenizers::Tokenizer::from_gguf(ct).map_err(|e| {
                    LocalError::Unsupported(format!(
                        "cannot build a tokenizer from this GGUF's byte-level BPE vocabulary ({e})"
                    ))
                })?;
                let dec = byte_decoder();
                for (i, tok) in tokens.iter().enumerate() {
                    if matches!(ty(i), TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNUSED) {
                        special.insert(tok.clone(), i as u32);
                        bytes.push(tok.as_bytes().to_vec());
                        is_special.push(true);
                    } else {
                        // A normal token's text is in the byte-level alphabet; characters
                        // outside it (should not occur) are kept as UTF-8.
                        let mut b = Vec::with_capacity(tok.len());
                        for c in tok.chars() {
                            match dec.get(&c) {
                                Some(&x) => b.push(x),
                                None => {
                                    let mut buf = [0u8; 4];
                                    b.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                                }
                            }
                        }
                        bytes.push(b);
                        is_special.push(false);
                    }
                }
                let add_bos = flag("tokenizer.ggml.add_bos_token").unwrap_or(false);
                (Encoder::Bpe(Box::new(hf)), add_bos)
            }
            "llama" => {
                let scores: Vec<f32> = ct
                    .metadata
                    .get("tokenizer.ggml.scores")
                    .and_then(|v| v.to_vec().ok())
                    .map(|v| v.iter().map(|x| x.to_f32().unwrap_or(0.0)).collect())
                    .unwrap_or_default();
                let vocab = SpmVocab::new(
                    &tokens,
                    &scores,
                    &types,
                    id("tokenizer.ggml.unknown_token_id"),
                    flag("tokenizer.ggml.add_space_prefix").unwrap_or(true),
                )?;
                for (i, tok) in tokens.iter().enumerate() {
                    let t = ty(i);
                    if matches!(t, TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNKNOWN) {
                        special.insert(tok.clone(), i as u32);
                    }
                    // User-defined pieces ("\n\n", runs of spaces, HTML tags) are ordinary
                    // text for grammars and prose checks; control tokens are not.
                    is_special.push(matches!(t, TYPE_CONTROL | TYPE_UNKNOWN | TYPE_UNUSED));
                    bytes.push(spm::piece_bytes(tok, t));
                }
                let add_bos = flag("tokenizer.ggml.add_bos_token").unwrap_or(true);
                (Encoder::Spm(Box::new(vocab)), add_bos)
            }
            other => {
                return Err(LocalError::Unsupported(format!(
                    "the GGUF's tokenizer model `{other}` is not supported (byte-level BPE `gpt2` and SentencePiece `llama` are)"
                )))
            }
        };
        let eos = id("tokenizer.ggml.eos_token_id")
            .or_else(|| special.get("<|im_end|>").copied())
            .ok_or_else(|| LocalError::Unsupported("the GGUF names no eos token".into()))?;
        let bos = id("tokenizer.ggml.bos_token_id").filter(|&b| (b as usize) < tokens.len());
        Ok(Self::assemble(
            encoder, bytes, special, is_special, eos, bos, add_bos,
        ))
    }

    /// The tokenizer of a Hugging Face snapshot folder: `tokenizer.json` (encoded by the
    /// `tokenizers` library) with the BOS/EOS names of `tokenizer_config.json` (default Gemma's
    /// `<bos>`/`<eos>`). Pieces are SentencePiece-style (`▁`, `<0xNN>`), as Gemma's are.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Self, LocalError> {
        let path = dir.join("tokenizer.json");
        let hf = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| LocalError::Tokenizer(format!("{}: {e}", path.display())))?;
        let config: serde_json::Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let name = |key: &str, default: &str| -> String {
            match &config[key] {
                serde_json::Value::String(s) => s.clone(),
                v => v["content"].as_str().unwrap_or(default).to_string(),
            }
        };
        let vocab = hf.get_vocab(true);
        let n = vocab.values().map(|&i| i as usize + 1).max().unwrap_or(0);
        let mut pieces = vec![String::new(); n];
        for (piece, &i) in &vocab {
            pieces[i as usize] = piece.clone();
        }
        let added = hf.get_added_tokens_decoder();
        let mut bytes = Vec::with_capacity(n);
        let mut special = HashMap::new();
        let mut is_special = Vec::with_capacity(n);
        for (i, piece) in pieces.iter().enumerate() {
            let ty = match added.get(&(i as u32)) {
                Some(a) if a.special => TYPE_CONTROL,
                Some(_) => TYPE_USER_DEFINED,
                None if spm::byte_token_value(piece).is_some() => spm::TYPE_BYTE,
                None if piece.is_empty() => TYPE_UNUSED,
                None => spm::TYPE_NORMAL,
            };
            if matches!(ty, TYPE_CONTROL | TYPE_USER_DEFINED) {
                special.insert(piece.clone(), i as u32);
            }
            is_special.push(matches!(ty, TYPE_CONTROL | TYPE_UNUSED));
            bytes.push(spm::piece_bytes(piece, ty));
        }
        let eos_name = name("eos_token", "<eos>");
        let eos = vocab.get(&eos_name).copied().ok_or_else(|| {
            LocalError::Tokenizer(format!("{}: no eos token {eos_name}", path.display()))
        })?;
        let bos = vocab.get(&name("bos_token", "<bos>")).copied();
        let add_bos = config["add_bos_token"].as_bool().unwrap_or(true);
        Ok(Self::assemble(
            Encoder::Bpe(Box::new(hf)),
            bytes,
            special,
            is_special,
            eos,
            bos,
            add_bos,
        ))
    }

    fn assemble(
        encoder: Encoder,
        bytes: Vec<Vec<u8>>,
        special: HashMap<String, u32>,
        is_special: Vec<bool>,
        eos: u32,
        bos: Option<u32>,
        add_bos: bool,
    ) -> Self {
        let mut stop_tokens = vec![eos];
        for name in [
            "<|im_end|>",
            "<|endoftext|>",
            "<|eot_id|>",
            "<end_of_turn>",
            "</s>",
        ] {
            if let Some(&t) = special.get(name) {
                if !stop_tokens.contains(&t) {
                    stop_tokens.push(t);
                }
            }
        }
        // The trie marks special tokens with a 0xFF prefix so grammars can name them (`<tool_call>`).
        let words: Vec<Vec<u8>> = bytes
            .iter()
            .zip(&is_special)
            .map(|(b, &s)| {
                if s {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(b);
                    w
                } else {
                    b.clone()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(words.len() as u32, eos);
        info.tok_end_of_turn = ["<|im_end|>", "<end_of_turn>", "<|eot_id|>"]
            .iter()
            .find_map(|n| special.get(*n).copied());
        let trie = Arc::new(TokTrie::from(&info, &words));
        GgufTokenizer {
            encoder,
            bytes,
            special,
            is_special,
            eos,
            bos,
            add_bos,
            stop_tokens,
            trie,
            prose_bans: std::sync::OnceLock::new(),
        }
    }

    /// The text of the BOS token when prompts must start with it (rendered by the chat template).
    pub fn bos_text(&self) -> Option<String> {
        let b = self.bos.filter(|_| self.add_bos)?;
        Some(String::from_utf8_lossy(self.token_bytes(b)).into_owned())
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// Tokenizes a rendered prompt; special-token text (`<|im_start|>`) becomes the special token,
    /// as llama.cpp does with `parse_special`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, LocalError> {
        self.encoder.encode(text)
    }

    /// The bytes a token stands for (special tokens: their name).
    pub fn token_bytes(&self, t: u32) -> &[u8] {
        self.bytes.get(t as usize).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Whether `t` is a special (control) token.
    pub fn is_special(&self, t: u32) -> bool {
        self.is_special.get(t as usize).copied().unwrap_or(false)
    }

    /// The id of the special token whose text is `name`, e.g. `<|im_end|>`.
    pub fn special(&self, name: &str) -> Option<u32> {
        self.special.get(name).copied()
    }

    /// The text of `tokens`, invalid UTF-8 replaced.
    pub fn decode(&self, tokens: &[u32]) -> String {
        let mut out = Vec::new();
        for &t in tokens {
            out.extend_from_slice(self.token_bytes(t));
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Tokens a prose-only answer may not use: `(anywhere, at_start)`. Anywhere: braces, so no
    /// JSON object can be written. At the start (before any non-blank text): tokens whose first
    /// non-blank character is not a letter, a digit or Markdown (`*`, `#`, `-`), so the answer
    /// cannot open with a code fence, a bracket or `>` before an echoed call.
    pub fn prose_bans(&self) -> &(Vec<u32>, Vec<u32>) {
        self.prose_bans.get_or_init(|| {
            let mut anywhere = Vec::new();
            let mut at_start = Vec::new();
            for t in 0..self.bytes.len() as u32 {
                if self.is_special(t) {
                    continue;
                }
                let b = self.token_bytes(t);
                if b.iter().any(|c| matches!(c, b'{' | b'}')) {
                    anywhere.push(t);
                    continue;
                }
                let opens_prose = match b.iter().find(|c| !c.is_ascii_whitespace()) {
                    None => true,
                    Some(c) => c.is_ascii_alphanumeric() || *c >= 0x80 || b"*#-".contains(c),
                };
                if !opens_prose {
                    at_start.push(t);
                }
            }
            (anywhere, at_start)
        })
    }

    /// The token trie the tool-call grammar matches against.
    pub fn trie(&self) -> Arc<TokTrie> {
        self.trie.clone()
    }

    /// The environment llguidance builds parsers from.
    pub fn env(self: &Arc<Self>) -> toktrie::TokEnv {
        Arc::new(TrieEnv { tok: self.clone() })
    }
}

struct TrieEnv {
    tok: Arc<GgufTokenizer>,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.tok.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Grammar literals are text; bytes that are not UTF-8 fall back to the trie's greedy split.
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tok
                .encoder
                .encode(text)
                .unwrap_or_else(|_| self.tok.trie.greedy_tokenize(s)),
            Err(_) => self.tok.trie.greedy_tokenize(s),
        }
    }
}

/// The chat template of a Hugging Face snapshot folder: `chat_template.jinja`, else
/// `chat_template.json`'s or `tokenizer_config.json`'s `chat_template`; `None` when none has one.
pub fn hf_chat_template(dir: &std::path::Path) -> Result<Option<String>, LocalError> {
    if let Ok(t) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
        return Ok(Some(t));
    }
    for file in ["chat_template.json", "tokenizer_config.json"] {
        let Ok(text) = std::fs::read_to_string(dir.join(file)) else {
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| LocalError::Template(format!("{}: {e}", dir.join(file).display())))?;
        if let Some(t) = v["chat_template"].as_str() {
            return Ok(Some(t.to_string()));
        }
    }
    Ok(None)
}

/// Turns a stream of token bytes into text, holding back an incomplete UTF-8 sequence.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds a token's bytes and returns the text now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let out = s.to_string();
                self.pending.clear();
                out
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // An invalid (not just incomplete) sequence is replaced rather than held forever.
                let cut = if e.error_len().is_some() {
                    self.pending.len()
                } else {
                    valid
                };
                let out = String::from_utf8_lossy(&self.pending[..cut]).into_owned();
                self.pending.drain(..cut);
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_decoder_is_a_bijection_on_256_bytes() {
        let d = byte_decoder();
        assert_eq!(d.len(), 256);
        let mut seen: Vec<u8> = d.values().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        // Space is shifted to 'Ġ' (U+0120), newline to 'Ċ' (U+010A) in GPT-2 vocabularies.
        assert_eq!(d[&'Ġ'], b' ');
        assert_eq!(d[&'Ċ'], b'\n');
        assert_eq!(d[&'a'], b'a');
    }

    #[test]
    fn utf8_stream_holds_back_split_characters() {
        let mut s = Utf8Stream::default();
        let e = "é".as_bytes();
        assert_eq!(s.push(&e[..1]), "");
        assert_eq!(s.push(&e[1..]), "é");
        assert_eq!(s.push(b"ok"), "ok");
        assert_eq!(s.push(&[0xff, b'a']), "\u{fffd}a");
    }
}
