//! A continuous-batching inference engine, modelled closely enough on vLLM's scheduler to show
//! the regimes that matter for admission control: light load (short queue, fast decode),
//! a big batch (every step slower, so everyone's decode slows), and KV-cache saturation
//! (new requests wait, the newest running ones are preempted and recomputed later, and time to
//! first token grows to tens of seconds).
//!
//! Pure: no I/O, no clock. Times are arguments (`now`, a [`Duration`] since the engine
//! started, in *simulated* time); the caller sleeps for [`Step::duration`] and then hands out
//! [`Step::emitted`]. The HTTP side lives in `examples/upstream.rs`.
//!
//! One step (vLLM V1's scheduler, simplified):
//! 1. Running sequences, oldest first, each get the tokens they need: one for a decoding
//!    sequence, the rest of the prompt (chunked by `max_batched_tokens`) for one still in
//!    prefill. A sequence whose KV would not fit takes the blocks of the *newest* running
//!    sequence, which is preempted: its KV is dropped and it goes back to the front of the
//!    waiting queue, to be recomputed (prompt + tokens generated so far) when it is readmitted.
//! 2. If nothing was preempted in this step, waiting sequences are admitted first come, first
//!    served, while fewer than `max_num_seqs` run, the step's token budget lasts, and the KV
//!    cache keeps a small watermark free.
//! 3. The step takes `step_base + step_per_seq × batch + prefill_per_token × prefill tokens`,
//!    times a small deterministic jitter. A sequence that finished its (re)prefill or decoded
//!    in this step emits one token at its end.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// Identifies a sequence (one request) inside the engine.
pub type SeqId = u64;

/// The engine's parameters. Defaults are the calibrated values in docs/lab.md.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Most sequences in one batch (vLLM `--max-num-seqs`).
    pub max_num_seqs: usize,
    /// KV-cache capacity in tokens (rounded down to whole blocks).
    pub kv_capacity_tokens: u64,
    /// Tokens per KV block (vLLM's default 16).
    pub block_size: u64,
    /// Token budget of one step (vLLM `--max-num-batched-tokens`): prefills are chunked to it.
    pub max_batched_tokens: u64,
    /// Fixed cost of a step: reading the weights once, whatever the batch.
    pub step_base: Duration,
    /// Extra step time per sequence in the batch (attention over its KV, sampling).
    pub step_per_seq: Duration,
    /// Extra step time per prompt token prefilled in the step.
    pub prefill_per_token: Duration,
    /// Fraction of KV blocks new admissions must leave free (vLLM's watermark, 1%).
    pub watermark: f64,
    /// Step times are multiplied by a factor drawn uniformly from [1 - jitter, 1 + jitter].
    pub jitter: f64,
    /// Seed of the jitter's generator, so runs repeat exactly.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            kv_capacity_tokens: 80_000,
            block_size: 16,
            max_batched_tokens: 8192,
            step_base: Duration::from_micros(50_000),
            step_per_seq: Duration::from_micros(400),
            prefill_per_token: Duration::from_micros(40),
            watermark: 0.01,
            jitter: 0.1,
            seed: 1,
        }
    }
}

#[derive(Debug, Clone)]
struct Seq {
    prompt_tokens: u64,
    max_output_tokens: u64,
    /// Tokens emitted so far.
    generated: u64,
    /// Tokens whose KV is in the cache.
    computed: u64,
    /// KV blocks held.
    blocks: u64,
}

impl Seq {
    /// Tokens this sequence must still run through the model before it can sample its next
    /// token: the whole prompt (plus, after a preemption, everything generated so far) while
    /// prefilling, one (the last sampled token) while decoding.
    fn pending(&self) -> u64 {
        self.prompt_tokens + self.generated - self.computed
    }
}

/// A token that became ready at the end of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Emitted {
    pub seq: SeqId,
    /// 0 for the first token of the sequence.
    pub index: u64,
    /// This was the sequence's last token; the engine has forgotten it.
    pub finished: bool,
}

/// What one step does: how long it takes and the tokens ready at its end.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub duration: Duration,
    pub emitted: Vec<Emitted>,
    /// Sequences in the batch.
    pub batch: usize,
    /// Prompt (or recomputed) tokens prefilled in this step.
    pub prefill_tokens: u64,
    /// Sequences preempted in this step.
    pub preempted: u64,
}

/// Counters since start, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub preemptions: u64,
    pub finished: u64,
    pub steps: u64,
}

/// The engine's state: waiting queue, running batch, KV blocks.
#[derive(Debug)]
pub struct Engine {
    params: Params,
    total_blocks: u64,
    used_blocks: u64,
    seqs: HashMap<SeqId, Seq>,
    waiting: VecDeque<SeqId>,
    /// In admission order: the last one is the newest, preempted first.
    running: Vec<SeqId>,
    next_id: SeqId,
    rng: u64,
    totals: Totals,
}

impl Engine {
    pub fn new(params: Params) -> Engine {
        let total_blocks = params.kv_capacity_tokens / params.block_size.max(1);
        let rng = params.seed | 1;
        Engine {
            params,
            total_blocks,
            used_blocks: 0,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            rng,
            totals: Totals::default(),
        }
    }

    /// Queues a request; it joins the batch at a later step.
    pub fn submit(&mut self, prompt_tokens: u64, max_output_tokens: u64) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            Seq {
                // An empty prompt still has a start token.
                prompt_tokens: prompt_tokens.max(1),
                max_output_tokens: max_output_tokens.max(1),
                generated: 0,
                computed: 0,
                blocks: 0,
            },
        );
        self.waiting.push_back(id);
        id
    }

    /// Drops a sequence (its client went away), freeing its KV. Unknown ids are ignored.
    pub fn cancel(&mut self, id: SeqId) {
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        self.used_blocks -= seq.blocks;
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Fraction of KV blocks in use, 0..=1.
    pub fn kv_usage(&self) -> f64 {
        if self.total_blocks == 0 {
            return 0.0;
        }
        self.used_blocks as f64 / self.total_blocks as f64
    }

    pub fn totals(&self) -> Totals {
        self.totals
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.params.block_size.max(1))
    }

    /// Preempts the newest running sequence: its KV is dropped and it waits again, at the
    /// front, to be recomputed.
    fn preempt_newest(&mut self) -> Option<SeqId> {
        let victim = self.running.pop()?;
        let seq = self.seqs.get_mut(&victim).expect("running ids are known");
        self.used_blocks -= seq.blocks;
        seq.blocks = 0;
        seq.computed = 0;
        self.waiting.push_front(victim);
        self.totals.preemptions += 1;
        Some(victim)
    }

    /// Plans and applies the step that starts at `now`; `None` when there is nothing to do.
    /// The tokens in the returned step become visible to clients at `now + duration`.
    pub fn step(&mut self, _now: Duration) -> Option<Step> {
        if self.is_idle() {
            return None;
        }
        let mut budget = self.params.max_batched_tokens.max(1);
        let mut scheduled: Vec<(SeqId, u64)> = Vec::new();
        let mut preempted = 0;

        // 1. The running batch, oldest first. A sequence that cannot get its KV preempts the
        //    newest, possibly itself.
        let mut index = 0;
        while index < self.running.len() && budget > 0 {
            let id = self.running[index];
            let seq = &self.seqs[&id];
            let tokens = seq.pending().min(budget);
            let needed = self
                .blocks_for(seq.computed + tokens)
                .saturating_sub(seq.blocks);
            let mut scheduled_it = false;
            while needed > self.total_blocks - self.used_blocks {
                let victim = self
                    .preempt_newest()
                    .expect("the batch holds at least `id`");
                preempted += 1;
                if victim == id {
                    break;
                }
            }
            if self.running.get(index) == Some(&id) {
                let seq = self.seqs.get_mut(&id).expect("running ids are known");
                seq.blocks += needed;
                self.used_blocks += needed;
                scheduled.push((id, tokens));
                budget -= tokens;
                scheduled_it = true;
            }
            if scheduled_it {
                index += 1;
            }
        }

        // 2. Admissions, first come first served, only in a step without preemption.
        let watermark = (self.total_blocks as f64 * self.params.watermark).ceil() as u64;
        while preempted == 0 && budget > 0 && self.running.len() < self.params.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let seq = &self.seqs[&id];
            let tokens = seq.pending().min(budget);
            let needed = self.blocks_for(tokens);
            if self.used_blocks + needed + watermark > self.total_blocks {
                // Head-of-line blocking, as in vLLM: later (smaller) requests do not jump it.
                break;
            }
            self.waiting.pop_front();
            self.running.push(id);
            let seq = self.seqs.get_mut(&id).expect("waiting ids are known");
            seq.blocks = needed;
            self.used_blocks += needed;
            scheduled.push((id, tokens));
            budget -= tokens;
        }

        // 3. Run it.
        let mut prefill_tokens = 0;
        let mut emitted = Vec::new();
        for &(id, tokens) in &scheduled {
            let seq = self.seqs.get_mut(&id).expect("scheduled ids are known");
            let decoding = seq.generated > 0 && seq.pending() == 1;
            if !decoding {
                prefill_tokens += tokens;
                self.totals.prompt_tokens += tokens;
            }
            seq.computed += tokens;
            if seq.pending() == 0 {
                let token_index = seq.generated;
                seq.generated += 1;
                self.totals.generation_tokens += 1;
                let finished = seq.generated >= seq.max_output_tokens;
                emitted.push(Emitted {
                    seq: id,
                    index: token_index,
                    finished,
                });
            }
        }
        for done in emitted.iter().filter(|e| e.finished) {
            let seq = self.seqs.remove(&done.seq).expect("emitting ids are known");
            self.used_blocks -= seq.blocks;
            self.running.retain(|&r| r != done.seq);
            self.totals.finished += 1;
        }

        let batch = scheduled.len();
        let nominal = self.params.step_base.as_secs_f64()
            + self.params.step_per_seq.as_secs_f64() * batch as f64
            + self.params.prefill_per_token.as_secs_f64() * prefill_tokens as f64;
        let factor = 1.0 + self.params.jitter * (2.0 * self.next_unit() - 1.0);
        self.totals.steps += 1;
        Some(Step {
            duration: Duration::from_secs_f64(nominal * factor.max(0.0)),
            emitted,
            batch,
            prefill_tokens,
            preempted,
        })
    }

    /// A uniform number in [0, 1) from xorshift64*; deterministic per seed.
    fn next_unit(&mut self) -> f64 {
        if self.params.jitter == 0.0 {
            return 0.5;
        }
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1_u64 << 53) as f64
    }
}

// Offline simulation: the tests' (and calibration's) driver of the step loop.

#[cfg(test)]
/// One request of an offline simulation: arrival (simulated seconds), prompt and output sizes.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    pub at: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
}

#[cfg(test)]
/// What an offline simulation measured for one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    /// Arrival to first token, seconds (engine only: no HTTP, no API overhead).
    pub ttft: f64,
    /// Mean time between later tokens, seconds.
    pub per_token: f64,
}

#[cfg(test)]
/// What an offline simulation saw of the engine.
#[derive(Debug, Clone, Copy, Default)]
pub struct Peaks {
    pub kv_usage: f64,
    pub running: usize,
    pub waiting: usize,
    pub preemptions: u64,
}

#[cfg(test)]
/// Runs `arrivals` (sorted by time) through an engine with no I/O at all: the step loop the
/// HTTP server runs, with time advanced by arithmetic. Used by the tests and to calibrate.
pub fn simulate(params: &Params, arrivals: &[Arrival]) -> (Vec<Outcome>, Peaks) {
    let mut engine = Engine::new(params.clone());
    let mut now = 0.0_f64;
    let mut next = 0;
    let mut by_seq: HashMap<SeqId, (usize, f64, Option<f64>)> = HashMap::new();
    let mut outcomes = vec![Outcome::default(); arrivals.len()];
    let mut peaks = Peaks::default();
    loop {
        while next < arrivals.len() && arrivals[next].at <= now {
            let a = arrivals[next];
            let id = engine.submit(a.prompt_tokens, a.output_tokens);
            by_seq.insert(id, (next, a.at, None));
            next += 1;
        }
        match engine.step(Duration::from_secs_f64(now)) {
            None if next < arrivals.len() => now = arrivals[next].at,
            None => break,
            Some(step) => {
                now += step.duration.as_secs_f64();
                for e in step.emitted {
                    let entry = by_seq.get_mut(&e.seq).expect("known seq");
                    if e.index == 0 {
                        entry.2 = Some(now);
                    }
                    if e.finished {
                        let (i, at, first) = by_seq.remove(&e.seq).expect("known seq");
                        let first = first.unwrap_or(now);
                        outcomes[i] = Outcome {
                            ttft: first - at,
                            per_token: if e.index > 0 {
                                (now - first) / e.index as f64
                            } else {
                                0.0
                            },
                        };
                    }
                }
                peaks.kv_usage = peaks.kv_usage.max(engine.kv_usage());
                peaks.running = peaks.running.max(engine.running());
                peaks.waiting = peaks.waiting.max(engine.waiting());
            }
        }
    }
    peaks.preemptions = engine.totals().preemptions;
    (outcomes, peaks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// Exact step times: no jitter, round numbers.
    fn exact() -> Params {
        Params {
            max_num_seqs: 8,
            kv_capacity_tokens: 16 * 1000,
            block_size: 16,
            max_batched_tokens: 1000,
            step_base: ms(40),
            step_per_seq: ms(1),
            prefill_per_token: Duration::from_micros(100),
            watermark: 0.0,
            jitter: 0.0,
            seed: 1,
        }
    }

    /// Runs steps until idle, returning every step.
    fn drain(engine: &mut Engine) -> Vec<Step> {
        let mut now = Duration::ZERO;
        let mut steps = Vec::new();
        while let Some(step) = engine.step(now) {
            now += step.duration;
            steps.push(step);
            assert!(steps.len() < 100_000, "the engine never went idle");
        }
        steps
    }

    #[test]
    fn step_time_grows_with_batch_and_prefill_tokens() {
        // (requests of (prompt, output), expected first step, expected second step)
        type Case = (&'static [(u64, u64)], Duration, Option<Duration>);
        let cases: &[Case] = &[
            // One 500-token prompt: 40 + 1 + 500 × 0.1 ms, then a decode step 40 + 1.
            (&[(500, 3)], ms(91), Some(ms(41))),
            // Two prompts in one step: 40 + 2 + 1000 × 0.1; then two decodes.
            (&[(500, 3), (500, 3)], ms(142), Some(ms(42))),
            // A prompt over the 1000-token budget is chunked: 1000 tokens, then 200.
            (&[(1200, 2)], ms(141), Some(ms(61))),
            // One-token outputs: done at the end of the prefill step.
            (&[(10, 1)], ms(42), None),
        ];
        for (requests, first, second) in cases {
            let mut engine = Engine::new(exact());
            for &(prompt, output) in *requests {
                engine.submit(prompt, output);
            }
            let steps = drain(&mut engine);
            assert_eq!(steps[0].duration, *first, "{requests:?}");
            assert_eq!(steps.get(1).map(|s| s.duration), *second, "{requests:?}");
        }
    }

    #[test]
    fn every_sequence_emits_its_tokens_in_order_and_finishes_once() {
        let mut engine = Engine::new(Params {
            // Tight KV: admissions block and sequences get preempted along the way.
            kv_capacity_tokens: 16 * 60,
            ..exact()
        });
        let sizes: Vec<(u64, u64)> = (0..20)
            .map(|i| (50 + 37 * i % 200, 1 + i % 7 * 9))
            .collect();
        let ids: Vec<SeqId> = sizes.iter().map(|&(p, o)| engine.submit(p, o)).collect();
        let mut seen: HashMap<SeqId, Vec<u64>> = HashMap::new();
        let mut finished = Vec::new();
        for step in drain(&mut engine) {
            for e in step.emitted {
                seen.entry(e.seq).or_default().push(e.index);
                if e.finished {
                    finished.push(e.seq);
                }
            }
        }
        assert!(engine.totals().preemptions > 0, "the case should preempt");
        for (id, &(_, output)) in ids.iter().zip(&sizes) {
            assert_eq!(seen[id], (0..output).collect::<Vec<_>>(), "seq {id}");
        }
        finished.sort_unstable();
        assert_eq!(finished, ids);
        assert_eq!(engine.kv_usage(), 0.0);
    }

    #[test]
    fn batch_is_capped_by_max_num_seqs_then_by_kv() {
        // (max_num_seqs, KV blocks, requests of 100 tokens, expected running after one step)
        let cases = [
            (8, 1000, 20, 8),   // max_num_seqs binds
            (64, 1000, 20, 10), // 1000-token step budget binds: 10 prompts of 100
            (64, 25, 20, 3),    // KV binds: 100 tokens take 7 blocks of 16
        ];
        for (max_num_seqs, blocks, requests, want) in cases {
            let mut engine = Engine::new(Params {
                max_num_seqs,
                kv_capacity_tokens: 16 * blocks,
                ..exact()
            });
            for _ in 0..requests {
                engine.submit(100, 50);
            }
            let step = engine.step(Duration::ZERO).expect("work to do");
            assert_eq!(
                engine.running(),
                want,
                "{max_num_seqs} seqs, {blocks} blocks"
            );
            assert_eq!(step.batch, want);
            assert_eq!(engine.waiting(), requests - want);
        }
    }

    #[test]
    fn kv_exhaustion_preempts_the_newest_which_recomputes_at_the_front() {
        // 13 blocks: two 96-token prompts (6 blocks each) fit, a 20-token one (2) does not.
        // Their 97th tokens need a 7th block each; only one is free, so the newer sequence
        // is preempted (here, to make room for itself).
        let mut engine = Engine::new(Params {
            kv_capacity_tokens: 16 * 13,
            ..exact()
        });
        let old = engine.submit(96, 40);
        let new = engine.submit(96, 40);
        let late = engine.submit(20, 5);
        let first = engine.step(Duration::ZERO).unwrap();
        assert_eq!(first.batch, 2, "the third does not fit");
        assert_eq!(first.preempted, 0);
        // Decode the first token's KV (96 → 97 tokens): the older one needs a new block.
        let second = engine.step(Duration::ZERO).unwrap();
        assert_eq!(second.preempted, 1);
        assert_eq!(engine.running(), 1);
        // The preempted one waits ahead of the one that never ran.
        assert_eq!(
            engine.waiting.iter().copied().collect::<Vec<_>>(),
            [new, late]
        );
        assert_eq!(engine.seqs[&old].generated, 2);
        assert_eq!(engine.seqs[&new].computed, 0, "its KV is gone");
        // Readmitted later, it recomputes prompt + generated (96 + 1) tokens.
        drain(&mut engine);
        assert_eq!(engine.totals().prompt_tokens, 96 + 96 + 20 + 97);
    }

    #[test]
    fn cancel_frees_kv_and_forgets_the_sequence() {
        let mut engine = Engine::new(exact());
        let a = engine.submit(160, 10);
        let b = engine.submit(160, 10);
        engine.step(Duration::ZERO);
        assert!(engine.kv_usage() > 0.0);
        engine.cancel(a);
        engine.cancel(b);
        engine.cancel(b); // twice is harmless
        assert_eq!(engine.kv_usage(), 0.0);
        assert!(engine.is_idle());
        assert!(engine.step(Duration::ZERO).is_none());
    }

    #[test]
    fn jitter_stays_in_band_and_repeats_per_seed() {
        let run = |seed| {
            let mut engine = Engine::new(Params {
                jitter: 0.2,
                seed,
                ..exact()
            });
            engine.submit(10, 200);
            drain(&mut engine)
                .iter()
                .map(|s| s.duration)
                .collect::<Vec<_>>()
        };
        let steps = run(7);
        assert_eq!(steps, run(7));
        assert_ne!(steps, run(8));
        for d in &steps[1..] {
            // A decode step is 41 ms ± 20%.
            assert!(*d >= ms(32) && *d <= ms(50), "{d:?}");
        }
    }

    /// Poisson arrivals at `rate` per second over [start, end), deterministic per seed.
    fn poisson(rate: f64, start: f64, end: f64, seed: u64) -> Vec<Arrival> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut t = start;
        let mut out = Vec::new();
        loop {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let u =
                ((x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 1.0) / (1_u64 << 53) as f64;
            t += -u.ln() / rate;
            if t >= end {
                return out;
            }
            out.push(Arrival {
                at: t,
                prompt_tokens: 512,
                output_tokens: 128,
            });
        }
    }

    fn percentile(mut values: Vec<f64>, p: f64) -> f64 {
        values.sort_by(f64::total_cmp);
        let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
        values[rank.clamp(1, values.len()) - 1]
    }

    /// What the seed-000 workload (512 in, 128 out; A at 2 rps and C at 1 rps for 120 s, and
    /// optionally B at 30 rps for 15 s from t = 30 s) measures on an engine with `params`:
    /// (TTFT p50, TTFT p99, median per-token time of requests arriving in [30, 60) s, peaks).
    fn seed_000(params: &Params, burst: bool) -> (f64, f64, f64, Peaks) {
        let mut arrivals = poisson(2.0, 0.0, 120.0, 1);
        arrivals.extend(poisson(1.0, 0.0, 120.0, 2));
        if burst {
            arrivals.extend(poisson(30.0, 30.0, 45.0, 3));
        }
        arrivals.sort_by(|a, b| a.at.total_cmp(&b.at));
        let (outcomes, peaks) = simulate(params, &arrivals);
        let ttft: Vec<f64> = outcomes.iter().map(|o| o.ttft).collect();
        let per_token: Vec<f64> = arrivals
            .iter()
            .zip(&outcomes)
            .filter(|(a, _)| (30.0..60.0).contains(&a.at))
            .map(|(_, o)| o.per_token)
            .collect();
        (
            percentile(ttft.clone(), 50.0),
            percentile(ttft, 99.0),
            percentile(per_token, 50.0),
            peaks,
        )
    }

    /// The calibration targets of docs/lab.md, with the default parameters and the seed's
    /// workload. Engine-only TTFT: the HTTP server adds `--api-overhead-ms` (90 ms) to it.
    /// `cargo test --example upstream calibration -- --nocapture` prints the figures.
    #[test]
    fn calibration_meets_the_seed_000_targets() {
        let params = Params::default();
        let light = seed_000(&params, false);
        let burst = seed_000(&params, true);
        for (name, (p50, p99, per_token, peaks)) in [("light", light), ("burst", burst)] {
            eprintln!(
                "{name}: engine TTFT p50 {:.0} ms p99 {:.0} ms, per-token p50 {:.1} ms, peak KV \
                 {:.0}%, peak running {}, peak waiting {}, preemptions {}",
                p50 * 1e3,
                p99 * 1e3,
                per_token * 1e3,
                peaks.kv_usage * 100.0,
                peaks.running,
                peaks.waiting,
                peaks.preemptions
            );
        }
        let (ttft_p50, _, itl, peaks) = light;
        assert!(
            (0.08..0.14).contains(&ttft_p50),
            "light TTFT p50 {ttft_p50}"
        );
        assert!((0.055..0.065).contains(&itl), "light per-token {itl}");
        assert!(peaks.kv_usage < 0.3, "light KV {}", peaks.kv_usage);
        assert_eq!(peaks.preemptions, 0);

        let (_, ttft_p99, itl_burst, peaks) = burst;
        assert!(peaks.kv_usage > 0.95, "burst KV {}", peaks.kv_usage);
        assert!(peaks.preemptions > 0);
        assert!(
            (1.7..2.6).contains(&(itl_burst / itl)),
            "burst per-token {itl_burst} vs {itl}"
        );
        assert!(ttft_p99 > 10.0, "burst TTFT p99 {ttft_p99}");
    }
}
