//! Cost of the fair queue's pure core (`tollgate::scheduler::fair::FairQueue`), in nanoseconds
//! per operation, with few and many tenants and short and long queues.
//!
//! ```sh
//! cargo run --release --example bench_scheduler
//! ```
//!
//! Each scenario fills the budget (1,000 slots), queues `queued` requests spread at random over
//! `tenants` tenants (weights 1 to 4, token costs 1 to 4,000), then measures:
//! - a steady-state cycle: release the oldest slot, `dispatch_next`, submit a new request for a
//!   random tenant (it queues, so the queue length stays put);
//! - `cancel` of random queued requests (mostly from the middle of their tenant's queue), on a
//!   fresh queue, down to half its length.
//!
//! Every scenario runs twice: without and with the headroom (`scheduler.headroom`, on by default
//! in tollgate; the clock moves 1 ms per cycle so the means decay as in service).
//!
//! Each figure is taken over many short chunks (100 of 10,000 cycles; 10 chunks of cancels per
//! fill, 5 fills): the best chunk shows the cost on an undisturbed core, the median how much a
//! busy machine adds (a chunk in which the thread was preempted is simply not the best). Nothing
//! here is asserted: see docs/benchmarks.md.

use std::collections::VecDeque;
use std::hint::black_box;

use std::time::Duration;
use tokio::time::Instant;

use tollgate::scheduler::fair::{EntryKey, FairQueue, FlowClass, FlowKey, Headroom, Submit};

const LIMIT: u32 = 1_000;
const CYCLE_CHUNKS: usize = 100;
const CYCLES_PER_CHUNK: usize = 10_000;
const CANCEL_CHUNKS: usize = 10;
const CANCEL_FILLS: u64 = 5;

/// A tiny deterministic generator (Knuth's MMIX LCG): the same requests on every run.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

struct Scenario {
    names: Vec<String>,
    queued: usize,
    headroom: bool,
}

impl Scenario {
    fn class(&self, tenant: usize) -> FlowClass {
        FlowClass {
            weight: 1 + (tenant % 4) as u32,
            band: 0,
            queue_max: u32::MAX,
            reserved_slots: 0,
        }
    }

    fn submit(&self, q: &mut FairQueue<u64>, rng: &mut Lcg, id: u64) -> Submit<u64> {
        let tenant = rng.below(self.names.len() as u64) as usize;
        let cost = 1 + rng.below(4_000);
        q.submit(&self.names[tenant], self.class(tenant), cost, id)
    }

    /// A queue with the budget full and `queued` requests waiting; returns the slots held
    /// (oldest first) and the waiting requests' keys.
    fn filled(&self, rng: &mut Lcg) -> (FairQueue<u64>, VecDeque<FlowKey>, Vec<EntryKey>) {
        let mut q = if self.headroom {
            FairQueue::with_headroom(
                LIMIT,
                Headroom {
                    window: Duration::from_secs(10),
                    sigmas: 3.0,
                    pace: true,
                },
            )
        } else {
            FairQueue::new(LIMIT)
        };
        q.advance(Instant::now());
        let mut held = VecDeque::new();
        let mut waiting = Vec::with_capacity(self.queued);
        let mut id = 0;
        while waiting.len() < self.queued {
            match self.submit(&mut q, rng, id) {
                Submit::Granted(flow) => held.push_back(flow),
                Submit::Queued(entry) => waiting.push(entry),
                Submit::Full(_) => unreachable!("queue_max is unbounded"),
            }
            id += 1;
        }
        (q, held, waiting)
    }

    /// Nanoseconds per release + dispatch_next + submit in steady state, one figure per chunk.
    fn cycle_ns(&self) -> Vec<f64> {
        let mut rng = Lcg(1);
        let (mut q, mut held, _) = self.filled(&mut rng);
        let mut id = 0;
        let mut chunks = Vec::with_capacity(CYCLE_CHUNKS);
        let mut clock = Instant::now();
        for _ in 0..CYCLE_CHUNKS {
            let started = Instant::now();
            for _ in 0..CYCLES_PER_CHUNK {
                clock += Duration::from_millis(1);
                q.advance(clock);
                // Backlogged tenants hold nothing back, so the freed slot is dispatched (and if
                // the headroom ever held it, the next release frees another).
                if let Some(oldest) = held.pop_front() {
                    q.release(oldest);
                }
                if let Some((flow, payload)) = q.dispatch_next() {
                    black_box(payload);
                    held.push_back(flow);
                }
                match self.submit(&mut q, &mut rng, id) {
                    Submit::Queued(entry) => {
                        black_box(entry);
                    }
                    Submit::Granted(flow) => held.push_back(flow),
                    Submit::Full(_) => unreachable!("queue_max is unbounded"),
                }
                id += 1;
            }
            chunks.push(started.elapsed().as_nanos() as f64 / CYCLES_PER_CHUNK as f64);
        }
        chunks
    }

    /// Nanoseconds per cancel of a random waiting request, down to half the queue, one figure
    /// per chunk.
    fn cancel_ns(&self) -> Vec<f64> {
        let mut chunks = Vec::new();
        for seed in 1..=CANCEL_FILLS {
            let mut rng = Lcg(seed);
            let (mut q, _, mut waiting) = self.filled(&mut rng);
            // Shuffle (Fisher-Yates) so cancels hit random tenants at random queue positions.
            for i in (1..waiting.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                waiting.swap(i, j);
            }
            let per_chunk = waiting.len() / 2 / CANCEL_CHUNKS;
            for chunk in waiting.chunks(per_chunk).take(CANCEL_CHUNKS) {
                let started = Instant::now();
                for &entry in chunk {
                    black_box(q.cancel(entry).expect("still waiting"));
                }
                chunks.push(started.elapsed().as_nanos() as f64 / chunk.len() as f64);
            }
        }
        chunks
    }
}

/// (best, median) of the chunk figures.
fn best_and_median(mut figures: Vec<f64>) -> (f64, f64) {
    figures.sort_by(f64::total_cmp);
    (figures[0], figures[figures.len() / 2])
}

fn main() {
    println!("limit {LIMIT}, budget full; cycle = release + dispatch_next + submit");
    println!("ns per operation: best chunk / median chunk");
    println!();
    println!("| headroom | tenants | queued  | active flows |    ns/cycle |   ns/cancel |");
    println!("|----------|--------:|--------:|-------------:|------------:|------------:|");
    for (headroom, tenants, queued) in [false, true].into_iter().flat_map(|headroom| {
        [10, 10_000]
            .into_iter()
            .flat_map(move |tenants| [1_000, 100_000].map(|queued| (headroom, tenants, queued)))
    }) {
        {
            let scenario = Scenario {
                names: (0..tenants).map(|i| format!("tenant-{i:05}")).collect(),
                queued,
                headroom,
            };
            let flows = scenario.filled(&mut Lcg(1)).0.flow_count();
            let (cycle, cycle_median) = best_and_median(scenario.cycle_ns());
            let (cancel, cancel_median) = best_and_median(scenario.cancel_ns());
            let cycle = format!("{cycle:.0} / {cycle_median:.0}");
            let cancel = format!("{cancel:.0} / {cancel_median:.0}");
            let headroom = if headroom { "on" } else { "off" };
            println!(
                "| {headroom:<8} | {tenants:>7} | {queued:>7} | {flows:>12} | {cycle:>11} | {cancel:>11} |"
            );
        }
    }
}
