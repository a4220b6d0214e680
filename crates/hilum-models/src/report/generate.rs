//! Greedy and beam-search decoding as Hugging Face transformers 4.57 does it for a
//! VisionEncoderDecoder (`GenerationMixin._sample` without sampling, `_beam_search`), batch 1:
//! the sequence starts with `decoder_start_token_id`, `max_length` counts that token, EOS ends a
//! sequence, beam scores are summed log-probabilities divided by `generated_len^length_penalty`
//! when a hypothesis finishes, and the search stops by the same early-stopping heuristic.

use candle_core::{Result, Tensor};

use super::bert_decoder::{log_softmax, BertDecoder, CrossKv, KvCache};

/// Decoding settings (names as in `GenerationConfig`).
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationConfig {
    /// Beams kept per step (1: greedy).
    pub num_beams: usize,
    /// Total length including the start token.
    pub max_length: usize,
    /// Exponent of the length dividing a finished beam's score (> 0 favours longer reports).
    pub length_penalty: f32,
    /// `true`: stop as soon as `num_beams` hypotheses are finished.
    pub early_stopping: bool,
    /// Token the decoder starts from.
    pub decoder_start_token_id: u32,
    /// Token that ends a report; `None` decodes to `max_length`.
    pub eos_token_id: Option<u32>,
}

/// What a decode produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// Token ids including the start token (and the EOS token when one ended the sequence).
    pub ids: Vec<u32>,
    /// Decoder forward passes run (one per generated position).
    pub steps: usize,
}

impl Generated {
    /// Tokens produced after the start token.
    pub fn new_tokens(&self) -> usize {
        self.ids.len().saturating_sub(1)
    }
}

const NEG: f32 = -1.0e9;

/// Greedy (`num_beams == 1`) or beam search over `decoder`, attending to `cross`.
pub fn generate(
    decoder: &BertDecoder,
    cross: &CrossKv,
    cfg: &GenerationConfig,
) -> Result<Generated> {
    if cfg.max_length < 2 {
        candle_core::bail!("max_length must be at least 2 (the start token and one more)");
    }
    if cfg.num_beams <= 1 {
        greedy(decoder, cross, cfg)
    } else {
        beam_search(decoder, cross, cfg)
    }
}

fn argmax(v: &[f32]) -> u32 {
    // The first maximum, as torch.argmax.
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn greedy(decoder: &BertDecoder, cross: &CrossKv, cfg: &GenerationConfig) -> Result<Generated> {
    let dev = decoder_device(cross)?;
    let mut ids = vec![cfg.decoder_start_token_id];
    let mut cache = KvCache::default();
    let mut steps = 0;
    while ids.len() < cfg.max_length {
        let last = Tensor::new(&[[ids[ids.len() - 1]]], &dev)?;
        let logits = decoder.next_logits(&last, &mut cache, cross)?;
        steps += 1;
        let next = argmax(&logits.squeeze(0)?.to_vec1::<f32>()?);
        ids.push(next);
        if Some(next) == cfg.eos_token_id {
            break;
        }
    }
    Ok(Generated { ids, steps })
}

fn decoder_device(cross: &CrossKv) -> Result<candle_core::Device> {
    cross.device()
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    let k = k.min(v.len());
    idx.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| {
        v[b].total_cmp(&v[a]).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx
}

struct Finished {
    seq: Vec<u32>,
    score: f32,
    done: bool,
}

fn beam_search(
    decoder: &BertDecoder,
    cross: &CrossKv,
    cfg: &GenerationConfig,
) -> Result<Generated> {
    let nb = cfg.num_beams;
    let dev = decoder_device(cross)?;
    let cross = cross.repeat(nb)?;
    let prompt_len = 1;
    let n_eos = usize::from(cfg.eos_token_id.is_some());
    let keep = 2.max(1 + n_eos) * nb;
    let lp = cfg.length_penalty;

    let mut running: Vec<Vec<u32>> = vec![vec![cfg.decoder_start_token_id]; nb];
    let mut running_scores: Vec<f32> = (0..nb).map(|i| if i == 0 { 0.0 } else { NEG }).collect();
    let mut finished: Vec<Finished> = (0..nb)
        .map(|_| Finished {
            seq: Vec::new(),
            score: NEG,
            done: false,
        })
        .collect();
    let mut heuristic_unsatisfied = true;
    let mut cache = KvCache::default();
    let mut cur_len = prompt_len;
    let mut steps = 0;

    loop {
        let last: Vec<u32> = running.iter().map(|s| s[s.len() - 1]).collect();
        let last = Tensor::from_vec(last, (nb, 1), &dev)?;
        let logits = decoder.next_logits(&last, &mut cache, &cross)?;
        steps += 1;
        let logp = log_softmax(&logits)?.to_vec2::<f32>()?;
        let vocab = logp[0].len();
        let mut acc = Vec::with_capacity(nb * vocab);
        for (b, row) in logp.iter().enumerate() {
            acc.extend(row.iter().map(|&x| x + running_scores[b]));
        }
        // Top `keep` continuations over all beams.
        let cand = top_k(&acc, keep);
        let cand_beam: Vec<usize> = cand.iter().map(|&i| i / vocab).collect();
        let cand_tok: Vec<u32> = cand.iter().map(|&i| (i % vocab) as u32).collect();
        let cand_lp: Vec<f32> = cand.iter().map(|&i| acc[i]).collect();
        let hits: Vec<bool> = cand_tok
            .iter()
            .map(|&t| Some(t) == cfg.eos_token_id || cur_len + 1 >= cfg.max_length)
            .collect();

        // Running beams for the next step: the best candidates that did not stop.
        let run_lp: Vec<f32> = cand_lp
            .iter()
            .zip(&hits)
            .map(|(&s, &h)| if h { s + NEG } else { s })
            .collect();
        let next = top_k(&run_lp, nb);
        let beam_idx: Vec<u32> = next.iter().map(|&k| cand_beam[k] as u32).collect();
        let new_running: Vec<Vec<u32>> = next
            .iter()
            .map(|&k| {
                let mut s = running[cand_beam[k]].clone();
                s.push(cand_tok[k]);
                s
            })
            .collect();
        let new_scores: Vec<f32> = next.iter().map(|&k| run_lp[k]).collect();

        // Finished hypotheses: only the top `nb` candidates may finish.
        let denom = ((cur_len + 1 - prompt_len) as f32).powf(lp);
        let all_done = finished.iter().all(|f| f.done);
        let mut merged: Vec<Finished> = std::mem::take(&mut finished);
        for k in 0..keep {
            let just_finished = hits[k] && k < nb;
            let mut s = cand_lp[k] / denom;
            if all_done && cfg.early_stopping {
                s += NEG;
            }
            if !heuristic_unsatisfied {
                s += NEG;
            }
            if !just_finished {
                s += NEG;
            }
            let mut seq = running[cand_beam[k]].clone();
            seq.push(cand_tok[k]);
            merged.push(Finished {
                seq,
                score: s,
                done: just_finished,
            });
        }
        let scores: Vec<f32> = merged.iter().map(|f| f.score).collect();
        let order = top_k(&scores, nb);
        let mut slots: Vec<Option<Finished>> = merged.into_iter().map(Some).collect();
        finished = order.iter().filter_map(|&i| slots[i].take()).collect();

        running = new_running;
        running_scores = new_scores;
        cache.reorder(&Tensor::from_vec(beam_idx, nb, &dev)?)?;
        cur_len += 1;

        // Can a running beam still beat the worst finished one?
        let best_possible = running_scores[0] / ((cur_len - prompt_len) as f32).powf(lp);
        let worst = finished
            .iter()
            .map(|f| f.score)
            .fold(f32::INFINITY, f32::min);
        let improvable = finished
            .iter()
            .any(|f| best_possible > if f.done { worst } else { NEG });
        heuristic_unsatisfied = heuristic_unsatisfied && improvable;

        let open = !(finished.iter().all(|f| f.done) && cfg.early_stopping);
        let can_continue = !hits.iter().all(|&h| h);
        if !(heuristic_unsatisfied && open && can_continue) {
            break;
        }
    }
    let best = finished
        .into_iter()
        .next()
        .map(|f| f.seq)
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| running.swap_remove(0));
    Ok(Generated { ids: best, steps })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_sorted_and_stable() {
        let v = [0.1, 0.5, 0.5, -1.0, 0.9];
        assert_eq!(top_k(&v, 3), vec![4, 1, 2]);
        assert_eq!(top_k(&v, 10).len(), 5);
    }

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }
}
