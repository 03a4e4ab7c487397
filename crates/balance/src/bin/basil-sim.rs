//! basil-sim: reproduce BASIL's evaluation (§6.3–§6.5) on the simulated testbed of
//! `balance::sim`, write the results as CSV into a directory, and print a Markdown summary.
//!
//! ```text
//! basil-sim OUTDIR [--seed N] [--configs N] [--cases-random N] [--cases-oracle N]
//!                  [--queueing saturating|linear]
//! ```
//!
//! `--queueing` picks how the simulated spindles share IOs (`balance::sim::Queueing`);
//! linear, the physics issue 5 specifies (latency linear in outstanding IOs over the
//! spindles), is the default; saturating pools the spindles as the nbdkit rig does. The
//! Table 2 check is printed for both either way.
//!
//! Files written to OUTDIR:
//! - `balance.csv`: one row per §6.4 configuration (placements, IOPS and latency before and
//!   after, the oracle's best);
//! - `balance_cdf.csv`: the empirical CDFs of Figure 10 (throughput gain, latency reduction,
//!   and the oracle's gain);
//! - `placement_random.csv`, `placement_random_cdf.csv`: §6.5's first set (Figure 11);
//! - `placement_oracle.csv`: §6.5's second set, with the throughput of every choice;
//! - `calibration.csv`: the paper's 750 calibration experiments on a simulated 4-spindle LUN;
//! - `summary.md`: what is printed.

use std::error::Error;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use balance::sim::{
    self, BalancingConfig, BalancingSummary, Physics, PlacementConfig, PlacementSummary, Queueing,
    TABLE1,
};
use balance::Constants;

/// Targets of issue 5.
const TARGET_GAIN_25_SHARE: f64 = 0.90;
const TARGET_BEST_CHOICE_SHARE: f64 = 0.80;
const SEED_DEFAULT: u64 = 2010;

struct Args {
    out: PathBuf,
    seed: u64,
    configs: usize,
    cases_random: usize,
    cases_oracle: usize,
    queueing: Queueing,
}

fn usage() -> String {
    "usage: basil-sim OUTDIR [--seed N] [--configs N] [--cases-random N] [--cases-oracle N] \
     [--queueing saturating|linear]\n\
     Reproduces BASIL §6.3-§6.5 on simulated spindles; writes CSV files to OUTDIR and prints \
     a Markdown summary."
        .to_string()
}

fn parse() -> Result<Args, String> {
    let mut out = None;
    let mut a = Args {
        out: PathBuf::new(),
        seed: SEED_DEFAULT,
        configs: 500,
        cases_random: 100,
        cases_oracle: 194,
        queueing: Queueing::Linear,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> Result<u64, String> {
            let v = it
                .next()
                .ok_or(format!("{name} needs a value\n{}", usage()))?;
            v.parse()
                .map_err(|_| format!("{name} {v}: not a non-negative integer\n{}", usage()))
        };
        match arg.as_str() {
            "-h" | "--help" => return Err(usage()),
            "--seed" => a.seed = num("--seed")?,
            "--configs" => a.configs = num("--configs")? as usize,
            "--cases-random" => a.cases_random = num("--cases-random")? as usize,
            "--cases-oracle" => a.cases_oracle = num("--cases-oracle")? as usize,
            "--queueing" => {
                a.queueing = match it.next().as_deref() {
                    Some("saturating") => Queueing::Saturating,
                    Some("linear") => Queueing::Linear,
                    v => {
                        return Err(format!(
                            "--queueing {}: not saturating or linear\n{}",
                            v.unwrap_or(""),
                            usage()
                        ))
                    }
                }
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}\n{}", usage())),
            s if out.is_none() => out = Some(PathBuf::from(s)),
            s => return Err(format!("unexpected argument {s}\n{}", usage())),
        }
    }
    a.out = out.ok_or_else(usage)?;
    Ok(a)
}

fn write(dir: &Path, name: &str, text: &str) -> Result<(), Box<dyn Error>> {
    let path = dir.join(name);
    fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(())
}

fn pct(x: f64) -> f64 {
    100.0 * x
}

fn joined(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(" ")
}

/// CDF columns side by side; each column sorted on its own.
fn cdf_csv(header: &str, columns: &[Vec<f64>]) -> String {
    let cdfs: Vec<Vec<(f64, f64)>> = columns.iter().map(|c| sim::cdf(c)).collect();
    let n = cdfs.first().map_or(0, Vec::len);
    let mut s = format!("{header}\n");
    for i in 0..n {
        let _ = write!(s, "{:.4}", cdfs[0][i].0);
        for c in &cdfs {
            let _ = write!(s, ",{:.2}", c.get(i).map_or(f64::NAN, |p| pct(p.1)));
        }
        s.push('\n');
    }
    s
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "**met**"
    } else {
        "**missed**"
    }
}

fn queueing_name(q: Queueing) -> &'static str {
    match q {
        Queueing::Saturating => "saturating",
        Queueing::Linear => "linear",
    }
}

/// BASIL Table 2's start (§6.2) on two testbeds under both queueing forms: the planner's
/// moves and their gain, the gain of the move the real-IO bench made (one OLTP disk from the
/// 3- to the 9-spindle LUN), and the oracle's.
fn table2(md: &mut String, seed: u64) {
    let (kinds, start) = sim::table2_start();
    let _ = writeln!(
        md,
        "### Table 2's start (§6.2) against the real-IO bench\n\n\
         | testbed | queueing | planner's moves | IOPS before → after | throughput | latency \
         | the real bench's move | oracle |\n\
         |---|---|---|---:|---:|---:|---:|---:|"
    );
    let testbeds = [
        (
            "simulated array (`Physics::PAPER`), 3/6/9 spindles",
            Physics::PAPER,
            vec![3, 6, 9],
        ),
        (
            "the rig (`Physics::NBDKIT_5MS`), 6/12/18 threads",
            Physics::NBDKIT_5MS,
            vec![6, 12, 18],
        ),
    ];
    for (name, physics, spindles) in testbeds {
        for queueing in [Queueing::Linear, Queueing::Saturating] {
            let cfg = BalancingConfig {
                physics: Physics {
                    queueing,
                    ..physics
                },
                spindles: spindles.clone(),
                ..BalancingConfig::paper(seed)
            };
            let config = usize::MAX - 1;
            let o = sim::balance_from(&cfg, config, &kinds, start.clone());
            let mut real = start.clone();
            real[1] = 2;
            let r = sim::score(&cfg, config, &kinds, &real);
            let moves: Vec<String> = o
                .rounds
                .iter()
                .flatten()
                .map(|&(w, to)| format!("{}-{w} → {}", kinds[w].name, spindles[to]))
                .collect();
            let _ = writeln!(
                md,
                "| {name} | {} | {} in {} rounds: {} | {:.0} → {:.0} | {:+.1} % | {:+.1} % \
                 | {:+.1} % | {} |",
                queueing_name(queueing),
                o.moves(),
                o.rounds.len(),
                moves.join(", "),
                o.before.iops,
                o.after.iops,
                pct(o.throughput_gain()),
                -pct(o.latency_reduction()),
                pct(r.iops / o.before.iops - 1.0),
                o.best_gain()
                    .map_or("—".into(), |g| format!("{:+.1} %", pct(g))),
            );
        }
    }
    let _ = writeln!(
        md,
        "\nReal IO (`bench/basil_real.sh`, docs/BENCHMARKS.md): one move, oltp 3 → 9, \
         +45 % and +47 % IOPS in two runs; BASIL's Table 2: three moves, +35 %.\n"
    );
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("basil-sim: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), Box<dyn Error>> {
    fs::create_dir_all(&args.out).map_err(|e| format!("creating {}: {e}", args.out.display()))?;
    let started = Instant::now();
    let physics = Physics {
        queueing: args.queueing,
        ..Physics::PAPER
    };
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## BASIL on simulated spindles (seed {}, {} queueing, `basil-sim`)\n",
        args.seed,
        queueing_name(args.queueing)
    );
    table2(&mut md, args.seed);

    // Calibration (§3) on a simulated 4-spindle LUN, with measurement noise.
    let experiments = sim::calibration_experiments(&physics, 4, Some(args.seed));
    let mut csv = String::from("oio,io_size_kib,read_pct,random_pct,latency_ms\n");
    for e in &experiments {
        let c = e.characteristics;
        let _ = writeln!(
            csv,
            "{},{},{},{},{:.4}",
            c.oio, c.io_size_kib, c.read_pct, c.random_pct, e.latency_ms
        );
    }
    write(&args.out, "calibration.csv", &csv)?;
    let d = Constants::DEFAULT;
    let _ = writeln!(md, "### Workload model calibration (§3)\n");
    match balance::workload::calibrate(&experiments) {
        Ok(cal) => {
            let k = cal.constants;
            let _ = writeln!(
                md,
                "The paper's 750 experiments on a simulated 4-spindle LUN with 5 % latency \
                 noise give K1 = {:.2}, K2 = {:.0}, K3 = {:.3}, K4 = {:.3} (defaults {}, {}, \
                 {}, {}), K5 = {:.0}; median error of the fitted latency {:.1} %. The runs \
                 below use the defaults.\n",
                k.k1,
                k.k2,
                k.k3,
                k.k4,
                d.k1,
                d.k2,
                d.k3,
                d.k4,
                cal.k5,
                pct(cal.median_relative_error)
            );
        }
        Err(e) => {
            let _ = writeln!(md, "Calibration failed: {e}\n");
        }
    }

    // §6.4.
    let bcfg = BalancingConfig {
        configs: args.configs,
        physics,
        ..BalancingConfig::paper(args.seed)
    };
    let outcomes = sim::run_balancing(&bcfg);
    let mut csv = String::from(
        "config,workloads,initial,balanced,rounds,moves,iops_before,iops_after,\
         throughput_gain_pct,latency_before_ms,latency_after_ms,latency_reduction_pct,\
         best_placement,best_iops,best_gain_pct\n",
    );
    for o in &outcomes {
        let (bp, bi) = o
            .best
            .as_ref()
            .map_or((String::new(), f64::NAN), |(p, perf)| {
                (joined(p), perf.iops)
            });
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{:.1},{:.1},{:.2},{:.3},{:.3},{:.2},{},{:.1},{:.2}",
            o.config,
            o.workloads.join(" "),
            joined(&o.initial),
            joined(&o.balanced),
            o.rounds.len(),
            o.moves(),
            o.before.iops,
            o.after.iops,
            pct(o.throughput_gain()),
            o.before.latency_ms,
            o.after.latency_ms,
            pct(o.latency_reduction()),
            bp,
            bi,
            o.best_gain().map_or(f64::NAN, pct),
        );
    }
    write(&args.out, "balance.csv", &csv)?;
    let gains: Vec<f64> = outcomes.iter().map(|o| o.throughput_gain()).collect();
    let reds: Vec<f64> = outcomes.iter().map(|o| o.latency_reduction()).collect();
    let best: Vec<f64> = outcomes.iter().filter_map(|o| o.best_gain()).collect();
    write(
        &args.out,
        "balance_cdf.csv",
        &cdf_csv(
            "fraction,throughput_gain_pct,latency_reduction_pct,best_gain_pct",
            &[gains, reds, best],
        ),
    )?;
    let s = BalancingSummary::new(&outcomes);
    let n = s.configs.max(1) as f64;
    let share25 = s.gain_25 as f64 / n;
    let _ = writeln!(
        md,
        "### Load balancing from random configurations (§6.4, Figure 10)\n\n\
         {} configurations of 8 random Table 1 workloads placed at random on LUNs of {:?} \
         spindles, balanced until a round proposes no move.\n\n\
         | measure | BASIL | best placement (oracle) | paper | target |\n\
         |---|---:|---:|---:|---:|\n\
         | configurations with ≥ 25 % more throughput | {:.1} % | {} | > 80 % | ≥ 90 %: {} |\n\
         | configurations with ≥ 33 % less latency | {:.1} % | | > 80 % | |\n\
         | median throughput gain | {:.1} % | {} | ≈ 50 % | |\n\
         | median latency reduction | {:.1} % | | ≈ 50 % | |\n\
         | configurations made worse | {} | | 0 | |\n\
         | mean moves per configuration | {:.2} | | | |\n\
         | median throughput as a share of the oracle's | {} | 100 % | | |\n",
        s.configs,
        bcfg.spindles,
        pct(share25),
        s.best_gain_25
            .map_or("—".into(), |b| format!("{:.1} %", 100.0 * b as f64 / n)),
        verdict(share25 >= TARGET_GAIN_25_SHARE),
        100.0 * s.reduction_33 as f64 / n,
        pct(s.median_gain),
        s.median_best_gain
            .map_or("—".into(), |g| format!("{:.1} %", pct(g))),
        pct(s.median_reduction),
        s.worse,
        s.mean_moves,
        s.median_share_of_best
            .map_or("—".into(), |g| format!("{:.1} %", pct(g))),
    );

    // §6.3: new device provisioning (Table 4's workloads).
    let kinds: Vec<_> = ["exchange", "webserver", "workstation", "oltp"]
        .iter()
        .flat_map(|n| {
            let k = *TABLE1.iter().find(|k| k.name == *n).expect("Table 1 type");
            [k, k]
        })
        .collect();
    let six = bcfg.spindles.iter().position(|&k| k == 6).unwrap_or(0);
    let o = sim::balance_from(&bcfg, usize::MAX, &kinds, vec![six; kinds.len()]);
    let _ = writeln!(
        md,
        "### New device provisioning (§6.3, Table 4)\n\n\
         All 8 workloads on the 6-spindle LUN, the others new: {} moves over {} rounds \
         (first round: {} moves); throughput {:+.1} % ({:.0} → {:.0} IOPS), latency {:+.1} % \
         ({:.1} → {:.1} ms). Paper: 5 moves over 2 rounds, +125 % and −62 %.\n",
        o.moves(),
        o.rounds.len(),
        o.rounds.first().map_or(0, Vec::len),
        pct(o.throughput_gain()),
        o.before.iops,
        o.after.iops,
        -pct(o.latency_reduction()),
        o.before.latency_ms,
        o.after.latency_ms,
    );

    // §6.5.
    let pcfg = PlacementConfig {
        cases_vs_random: args.cases_random,
        cases_vs_oracle: args.cases_oracle,
        physics,
        ..PlacementConfig::paper(args.seed)
    };
    let study = sim::run_placement(&pcfg);
    let mut csv = String::from(
        "case,workloads,basil,random,iops_basil,iops_random,throughput_gain_pct,\
         latency_basil_ms,latency_random_ms,latency_reduction_pct,fallbacks\n",
    );
    for c in &study.vs_random {
        let _ = writeln!(
            csv,
            "{},{},{},{},{:.1},{:.1},{:.2},{:.3},{:.3},{:.2},{}",
            c.case,
            c.workloads.join(" "),
            joined(&c.basil),
            joined(&c.random),
            c.basil_perf.iops,
            c.random_perf.iops,
            pct(c.throughput_gain()),
            c.basil_perf.latency_ms,
            c.random_perf.latency_ms,
            pct(c.latency_reduction()),
            c.fallbacks
        );
    }
    write(&args.out, "placement_random.csv", &csv)?;
    write(
        &args.out,
        "placement_random_cdf.csv",
        &cdf_csv(
            "fraction,throughput_gain_pct,latency_reduction_pct",
            &[
                study
                    .vs_random
                    .iter()
                    .map(|c| c.throughput_gain())
                    .collect(),
                study
                    .vs_random
                    .iter()
                    .map(|c| c.latency_reduction())
                    .collect(),
            ],
        ),
    )?;
    let mut csv = String::from("case,workloads,placed,basil,random,best,basil_rank,random_rank");
    for k in &pcfg.spindles {
        let _ = write!(csv, ",iops_if_on_{k}disk");
    }
    csv.push('\n');
    for c in &study.vs_oracle {
        let _ = write!(
            csv,
            "{},{},{},{},{},{},{},{}",
            c.case,
            c.workloads.join(" "),
            joined(&c.placed),
            c.basil,
            c.random,
            c.best(),
            c.rank(c.basil),
            c.rank(c.random)
        );
        for p in &c.perf_by_datastore {
            let _ = write!(csv, ",{:.1}", p.iops);
        }
        csv.push('\n');
    }
    write(&args.out, "placement_oracle.csv", &csv)?;
    let p = PlacementSummary::new(&study);
    let no = p.cases_vs_oracle.max(1) as f64;
    let best_share = p.basil_best as f64 / no;
    let _ = writeln!(
        md,
        "### Initial placement (§6.5, Figure 11)\n\n\
         | measure | BASIL | random | paper | target |\n\
         |---|---:|---:|---:|---:|\n\
         | median throughput gain over random placement ({} cases) | {:.1} % | | 53 % | |\n\
         | median latency reduction over random placement | {:.1} % | | 45 % | |\n\
         | best datastore chosen for the 8th disk ({} cases) | {:.1} % | {:.1} % | 68 % | ≥ 80 %: {} |\n\
         | mean throughput lost against the best choice | {:.2} % | {:.2} % | | |\n\n\
         Placements BASIL could not make: {}.\n",
        p.cases_vs_random,
        pct(p.median_gain_vs_random),
        pct(p.median_reduction_vs_random),
        p.cases_vs_oracle,
        pct(best_share),
        100.0 * p.random_best as f64 / no,
        verdict(best_share >= TARGET_BEST_CHOICE_SHARE),
        pct(p.basil_mean_regret),
        pct(p.random_mean_regret),
        p.fallbacks,
    );
    write(&args.out, "summary.md", &md)?;
    print!("{md}");
    eprintln!(
        "basil-sim: wrote {} in {:.1} s",
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
