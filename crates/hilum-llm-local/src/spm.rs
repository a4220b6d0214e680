//! SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`: Gemma, Llama 2, Mistral), tokenized
//! the way llama.cpp does it, so prompts get the same ids the model was run with there:
//! 1. special-token text (control and user-defined tokens) is split out first, longest token
//!    first, each occurrence from the left;
//! 2. in the remaining text spaces become "▁" (and a leading "▁" is added after a special token
//!    when the GGUF asks for `add_space_prefix`);
//! 3. characters are merged pairwise, always the adjacent pair whose merged text is the vocabulary
//!    entry with the highest score (ties: the leftmost pair), until no pair is in the vocabulary;
//! 4. a character that is not itself a token is written as its UTF-8 bytes (`<0xNN>` tokens).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet};

use crate::LocalError;

// GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
pub(crate) const TYPE_NORMAL: i64 = 1;
pub(crate) const TYPE_UNKNOWN: i64 = 2;
pub(crate) const TYPE_CONTROL: i64 = 3;
pub(crate) const TYPE_USER_DEFINED: i64 = 4;
pub(crate) const TYPE_UNUSED: i64 = 5;
pub(crate) const TYPE_BYTE: i64 = 6;

const SPACE: &str = "\u{2581}";

pub(crate) struct SpmVocab {
    /// Text of each token -> id (the last id wins for a repeated text, as in llama.cpp).
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// Texts split out before the merges: (text, id), longest first, then by id.
    specials: Vec<(String, u32)>,
    /// The distinct byte lengths of `specials` by first byte, to find which of them occur.
    special_lens: Vec<Vec<usize>>,
    special_index: HashMap<String, usize>,
    byte_tokens: [Option<u32>; 256],
    unk: Option<u32>,
    add_space_prefix: bool,
}

/// A candidate merge of two adjacent symbols into a vocabulary entry.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    // BinaryHeap pops the greatest: highest score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A span of the text being merged: `start..start + len`, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

enum Fragment {
    Text(usize, usize),
    Token(u32),
}

impl SpmVocab {
    pub(crate) fn new(
        tokens: &[String],
        scores: &[f32],
        types: &[i64],
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Result<Self, LocalError> {
        if scores.len() != tokens.len() {
            return Err(LocalError::Tokenizer(format!(
                "the GGUF has {} tokens but {} scores",
                tokens.len(),
                scores.len()
            )));
        }
        let mut ids = HashMap::with_capacity(tokens.len());
        let mut specials = Vec::new();
        let mut byte_tokens = [None; 256];
        for (i, tok) in tokens.iter().enumerate() {
            let id = i as u32;
            ids.insert(tok.clone(), id);
            match types.get(i).copied().unwrap_or(TYPE_NORMAL) {
                TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNKNOWN if !tok.is_empty() => {
                    specials.push((tok.clone(), id))
                }
                TYPE_BYTE => {
                    if let Some(b) = byte_token_value(tok) {
                        byte_tokens[b as usize] = Some(id);
                    }
                }
                _ => {}
            }
        }
        // Fallback for a byte without a <0xNN> token: the one-character token of that byte.
        for (b, slot) in byte_tokens.iter_mut().enumerate().take(0x80) {
            if slot.is_none() {
                *slot = ids.get(&(b as u8 as char).to_string()).copied();
            }
        }
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let special_index = specials
            .iter()
            .enumerate()
            .map(|(i, (t, _))| (t.clone(), i))
            .collect();
        let mut special_lens = vec![Vec::new(); 256];
        for (t, _) in &specials {
            let lens: &mut Vec<usize> = &mut special_lens[t.as_bytes()[0] as usize];
            if !lens.contains(&t.len()) {
                lens.push(t.len());
            }
        }
        Ok(SpmVocab {
            ids,
            scores: scores.to_vec(),
            specials,
            special_lens,
            special_index,
            byte_tokens,
            unk,
            add_space_prefix,
        })
    }

    /// Tokenizes `text` with special-token text parsed (llama.cpp's `parse_special`), without BOS.
    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u32>, LocalError> {
        let mut out = Vec::new();
        let mut prev_special = true;
        for frag in self.partition(text) {
            match frag {
                Fragment::Token(t) => {
                    out.push(t);
                    prev_special = true;
                }
                Fragment::Text(a, b) => {
                    let mut s = String::with_capacity(b - a + 3);
                    if self.add_space_prefix && prev_special {
                        s.push_str(SPACE);
                    }
                    s.push_str(&text[a..b].replace(' ', SPACE));
                    self.merge(&s, &mut out)?;
                    prev_special = false;
                }
            }
        }
        Ok(out)
    }

    /// Splits special-token text out of `text`, longest token first, each from the left.
    fn partition(&self, text: &str) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(0, text.len()));
        // Only the special tokens that occur somewhere in the text can split it.
        let bytes = text.as_bytes();
        let mut present: HashSet<usize> = HashSet::new();
        for (i, &b) in bytes.iter().enumerate() {
            for &l in &self.special_lens[b as usize] {
                if let Some(s) = text.get(i..i + l) {
                    if let Some(&k) = self.special_index.get(s) {
                        present.insert(k);
                    }
                }
            }
        }
        let mut order: Vec<usize> = present.into_iter().collect();
        order.sort_unstable();
        for k in order {
            let (stext, id) = &self.specials[k];
            let mut next = Vec::with_capacity(frags.len() + 2);
            for frag in frags {
                let Fragment::Text(mut a, b) = frag else {
                    next.push(frag);
                    continue;
                };
                while let Some(m) = text[a..b].find(stext.as_str()) {
                    if m > 0 {
                        next.push(Fragment::Text(a, a + m));
                    }
                    next.push(Fragment::Token(*id));
                    a += m + stext.len();
                }
                if a < b {
                    next.push(Fragment::Text(a, b));
                }
            }
            frags = next;
        }
        frags
    }

    /// The score-ordered pair merges on one piece of text (spaces already escaped).
    fn merge(&self, text: &str, out: &mut Vec<u32>) -> Result<(), LocalError> {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
        }
        let n = symbols.len();
        if n == 0 {
            return Ok(());
        }
        for (i, s) in symbols.iter_mut().enumerate() {
            s.next = (i + 1 < n).then_some(i + 1);
        }
        let mut queue = BinaryHeap::new();
        for i in 1..n {
            self.push_bigram(text, &symbols, Some(i - 1), Some(i), &mut queue);
        }
        while let Some(bg) = queue.pop() {
            let (l, r) = (symbols[bg.left], symbols[bg.right]);
            // Stale: one side was merged into something else since this pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != bg.size {
                continue;
            }
            symbols[bg.left].len += r.len;
            symbols[bg.right].len = 0;
            symbols[bg.left].next = r.next;
            if let Some(nx) = r.next {
                symbols[nx].prev = Some(bg.left);
            }
            let left = symbols[bg.left];
            self.push_bigram(text, &symbols, left.prev, Some(bg.left), &mut queue);
            self.push_bigram(text, &symbols, Some(bg.left), left.next, &mut queue);
        }
        let mut i = Some(0);
        while let Some(k) = i {
            let s = symbols[k];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&t) => out.push(t),
                None => {
                    for &b in piece.as_bytes() {
                        out.push(self.byte_token(b)?);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }

    fn push_bigram(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: Option<usize>,
        right: Option<usize>,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        let size = l.len + r.len;
        let Some(&id) = self.ids.get(&text[l.start..l.start + size]) else {
            return;
        };
        queue.push(Bigram {
            score: self.scores.get(id as usize).copied().unwrap_or(f32::MIN),
            left,
            right,
            size,
        });
    }

    fn byte_token(&self, b: u8) -> Result<u32, LocalError> {
        self.byte_tokens[b as usize].or(self.unk).ok_or_else(|| {
            LocalError::Tokenizer(format!(
                "the vocabulary has no token for byte 0x{b:02X} and no unknown token"
            ))
        })
    }
}

/// The byte a `<0xNN>` token stands for.
pub(crate) fn byte_token_value(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// What a token of a SentencePiece vocabulary writes: "▁" is a space, `<0xNN>` one byte.
pub(crate) fn piece_bytes(text: &str, ty: i64) -> Vec<u8> {
    match ty {
        TYPE_BYTE => byte_token_value(text).map_or_else(|| text.as_bytes().to_vec(), |b| vec![b]),
        TYPE_NORMAL => text.replace(SPACE, " ").into_bytes(),
        _ => text.as_bytes().to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: specials, bytes, then scored pieces.
    fn vocab(add_space_prefix: bool) -> SpmVocab {
        let mut toks: Vec<(String, f32, i64)> = vec![
            ("<unk>".into(), 0.0, TYPE_UNKNOWN),
            ("<bos>".into(), 0.0, TYPE_CONTROL),
            ("<turn>".into(), 0.0, TYPE_CONTROL),
            ("\n".into(), 0.0, TYPE_USER_DEFINED),
            ("\n\n".into(), 0.0, TYPE_USER_DEFINED),
        ];
        for b in 0..=255u8 {
            toks.push((format!("<0x{b:02X}>"), 0.0, TYPE_BYTE));
        }
        for (t, s) in [
            ("a", -1.0),
            ("b", -1.0),
            ("c", -1.0),
            ("▁", -1.0),
            ("ab", -2.0),
            ("bc", -1.5),
            ("▁a", -2.5),
            ("é", -1.0),
        ] {
            toks.push((t.into(), s, TYPE_NORMAL));
        }
        let texts: Vec<String> = toks.iter().map(|t| t.0.clone()).collect();
        let scores: Vec<f32> = toks.iter().map(|t| t.1).collect();
        let types: Vec<i64> = toks.iter().map(|t| t.2).collect();
        SpmVocab::new(&texts, &scores, &types, Some(0), add_space_prefix).unwrap()
    }

    fn pieces(v: &SpmVocab, text: &str) -> Vec<String> {
        let by_id: HashMap<u32, &String> = v.ids.iter().map(|(t, &i)| (i, t)).collect();
        v.encode(text)
            .unwrap()
            .into_iter()
            .map(|i| by_id[&i].clone())
            .collect()
    }

    #[test]
    fn highest_score_pair_merges_first() {
        let v = vocab(false);
        // "bc" (-1.5) beats "ab" (-2.0); "a"+"bc" is not a token, so it stops there.
        assert_eq!(pieces(&v, "abc"), ["a", "bc"]);
        assert_eq!(pieces(&v, "ab"), ["ab"]);
        // "ab" (-2.0) beats the leftmost "▁a" (-2.5).
        assert_eq!(pieces(&v, " ab"), ["▁", "ab"]);
        assert_eq!(pieces(&v, "b a"), ["b", "▁a"]);
    }

    #[test]
    fn unknown_characters_become_bytes() {
        let v = vocab(false);
        assert_eq!(pieces(&v, "xé"), ["<0x78>", "é"]);
        assert_eq!(pieces(&v, "ü"), ["<0xC3>", "<0xBC>"]);
    }

    #[test]
    fn special_text_is_split_out_longest_first() {
        let v = vocab(false);
        assert_eq!(
            pieces(&v, "<bos>a\n\n\nb<turn>"),
            ["<bos>", "a", "\n\n", "\n", "b", "<turn>"]
        );
        assert_eq!(pieces(&v, ""), Vec::<String>::new());
    }

    #[test]
    fn space_prefix_follows_special_tokens() {
        let v = vocab(true);
        assert_eq!(pieces(&v, "a<turn>a"), ["▁a", "<turn>", "▁a"]);
    }

    #[test]
    fn pieces_decode_to_bytes() {
        assert_eq!(piece_bytes("▁a▁b", TYPE_NORMAL), b" a b");
        assert_eq!(piece_bytes("<0x0A>", TYPE_BYTE), b"\n");
        assert_eq!(piece_bytes("<bos>", TYPE_CONTROL), b"<bos>");
        assert_eq!(byte_token_value("<0xZZ>"), None);
    }
}
