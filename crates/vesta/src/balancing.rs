//! The balancing commands (BASIL, DESIGN §8): `vesta stats --models`, `vesta balance plan`
//! and `vesta calibrate`. The first two print what the daemon computes; `calibrate` runs its
//! fio sweep here, on the host, against a scratch volume, fits the constants with the pure
//! `balance` crate and stores them in the daemon.

use std::process::Command;
use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use balance::workload::{self, Characteristics, Experiment};
use vesta_api as api;

use crate::{table, Client};

fn num(v: f64, digits: usize) -> String {
    format!("{v:.digits$}")
}

pub fn print_models(r: &api::ModelsReport) {
    let k = &r.constants;
    println!(
        "workload model: L = ({} + OIO)({} + KiB)({} + read)({} + random), constants from {}",
        num(k.k1, 2),
        num(k.k2, 1),
        num(k.k3, 3),
        num(k.k4, 3),
        r.constants_from
    );
    println!(
        "history: up to {} intervals of {} s; characteristics at their 90th percentile",
        r.history, r.interval_s
    );
    table(
        &[
            "VOLUME",
            "DATASTORE",
            "HOST",
            "SAMPLES",
            "OIO",
            "KiB",
            "READ%",
            "RANDOM%",
            "IOPS",
            "L",
        ],
        r.volumes
            .iter()
            .map(|v| {
                let c = |f: fn(&Characteristics) -> f64, d: usize| {
                    v.p90.as_ref().map(|p| num(f(p), d)).unwrap_or("-".into())
                };
                vec![
                    v.name.clone(),
                    v.datastore.clone(),
                    v.host.clone().unwrap_or_else(|| "(this)".into()),
                    v.samples.to_string(),
                    c(|p| p.oio, 1),
                    c(|p| p.io_size_kib, 1),
                    c(|p| p.read_pct, 0),
                    c(|p| p.random_pct, 0),
                    num(v.iops, 0),
                    num(v.load, 0),
                ]
            })
            .collect(),
    );
    println!();
    table(
        &[
            "DATASTORE",
            "HOSTS",
            "SAMPLES",
            "USABLE",
            "OIO",
            "P",
            "SLOPE-ms/OIO",
            "FIT-R2",
            "LOAD",
            "N",
        ],
        r.datastores
            .iter()
            .map(|d| {
                let m = |f: fn(&balance::DeviceModel) -> f64, digits: usize| {
                    d.model
                        .as_ref()
                        .map(|m| num(f(m), digits))
                        .unwrap_or("-".into())
                };
                vec![
                    d.name.clone(),
                    match d.hosts.len() {
                        0 => "-".into(),
                        1..=3 => d.hosts.join(","),
                        n => format!("{n} hosts"),
                    },
                    d.samples.to_string(),
                    d.usable.to_string(),
                    d.read_oio_median
                        .map(|o| num(o, 1))
                        .unwrap_or_else(|| "-".into()),
                    m(|m| m.performance, 3),
                    m(|m| m.slope_ms_per_oio, 3),
                    m(|m| m.r_squared, 2),
                    num(d.load, 0),
                    d.normalized_load
                        .map(|n| num(n, 0))
                        .unwrap_or_else(|| "-".into()),
                ]
            })
            .collect(),
    );
}

pub fn print_plan(p: &api::BalancePlan) {
    let plan = &p.plan;
    let why = match plan.stop {
        balance::plan::Stop::Balanced => "balanced: f is at or under the threshold",
        balance::plan::Stop::MoveCap => "the plan reached its cap on moves",
        balance::plan::Stop::NoImprovingMove => "no allowed move lowers f enough",
    };
    println!(
        "imbalance f {:.3} -> {:.3} with {} move(s) ({why}); constants from {}",
        plan.imbalance_before,
        plan.imbalance_after,
        plan.moves.len(),
        p.constants_from
    );
    if !plan.moves.is_empty() {
        println!();
        table(
            &["#", "VOLUME", "FROM", "TO", "L", "GiB", "f-AFTER"],
            plan.moves
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    vec![
                        (i + 1).to_string(),
                        m.workload.clone(),
                        m.from.clone(),
                        m.to.clone(),
                        num(m.load, 0),
                        num(m.size_gib, 1),
                        num(m.imbalance_after, 3),
                    ]
                })
                .collect(),
        );
    }
    println!();
    table(
        &["DATASTORE", "MODEL", "P", "N-BEFORE", "N-AFTER", "VOLUMES"],
        plan.before
            .iter()
            .map(|b| {
                let a = plan.after.iter().find(|a| a.datastore == b.datastore);
                vec![
                    b.datastore.clone(),
                    if b.modeled { "fitted" } else { "assumed" }.to_string(),
                    num(b.performance, 3),
                    num(b.normalized_load, 0),
                    a.map(|a| num(a.normalized_load, 0)).unwrap_or_default(),
                    match a {
                        Some(a) if a.workloads != b.workloads => {
                            format!("{} -> {}", b.workloads, a.workloads)
                        }
                        _ => b.workloads.to_string(),
                    },
                ]
            })
            .collect(),
    );
    for n in &p.notes {
        println!("note: {n}");
    }
    if !plan.moves.is_empty() {
        println!();
        println!(
            "carry a move out with `vesta volume relocate VOLUME --datastore TO --offline` \
             once its clients are detached"
        );
    }
}

/// The short sweep: a centre point and each parameter varied alone around it, which is what
/// the pairwise fit needs (every pair differs in one parameter). 16 experiments.
pub fn short_grid() -> Vec<Characteristics> {
    let centre = Characteristics {
        oio: 16.0,
        io_size_kib: 16.0,
        read_pct: 50.0,
        random_pct: 50.0,
    };
    let mut out = vec![centre];
    for oio in [4.0, 8.0, 32.0, 64.0] {
        out.push(Characteristics { oio, ..centre });
    }
    for io_size_kib in [8.0, 32.0, 128.0] {
        out.push(Characteristics {
            io_size_kib,
            ..centre
        });
    }
    for read_pct in [0.0, 25.0, 75.0, 100.0] {
        out.push(Characteristics { read_pct, ..centre });
    }
    for random_pct in [0.0, 25.0, 75.0, 100.0] {
        out.push(Characteristics {
            random_pct,
            ..centre
        });
    }
    out
}

/// Mean latency (ms) over all IOs of one fio run, from its JSON output.
fn fio_mean_latency_ms(json: &serde_json::Value) -> anyhow::Result<f64> {
    let job = json
        .get("jobs")
        .and_then(|j| j.get(0))
        .ok_or_else(|| anyhow!("fio printed no job"))?;
    let mut ios = 0.0;
    let mut sum_ns = 0.0;
    for dir in ["read", "write"] {
        let d = &job[dir];
        let n = d["total_ios"].as_f64().unwrap_or(0.0);
        let mean = d["lat_ns"]["mean"].as_f64().unwrap_or(0.0);
        ios += n;
        sum_ns += n * mean;
    }
    if ios <= 0.0 {
        bail!("fio completed no IO");
    }
    Ok(sum_ns / ios / 1e6)
}

fn run_fio(uri: &str, c: &Characteristics, runtime_s: u32) -> anyhow::Result<f64> {
    let out = Command::new("fio")
        .args([
            "--name=calibrate",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            &format!("--rwmixread={}", c.read_pct as u32),
            &format!("--percentage_random={}", c.random_pct as u32),
            &format!("--bs={}k", c.io_size_kib as u32),
            &format!("--iodepth={}", c.oio as u32),
            "--time_based",
            &format!("--runtime={runtime_s}"),
            "--ramp_time=1",
            "--output-format=json",
        ])
        .output()
        .context("cannot run fio; install it (Debian: apt-get install fio)")?;
    if !out.status.success() {
        bail!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    // fio may print notes before the JSON document.
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text
        .find('{')
        .ok_or_else(|| anyhow!("fio printed no JSON"))?;
    let json: serde_json::Value =
        serde_json::from_str(&text[start..]).context("fio's JSON output")?;
    fio_mean_latency_ms(&json)
}

pub struct CalibrateArgs {
    pub datastore: String,
    pub full: bool,
    pub runtime_s: u32,
    pub size: u64,
    pub json: bool,
}

/// Runs the sweep against a scratch volume, fits K1–K5, stores the constants.
pub fn calibrate(c: &Client, a: CalibrateArgs) -> anyhow::Result<()> {
    let grid = if a.full {
        workload::paper_experiment_grid()
    } else {
        short_grid()
    };
    let name = format!("calibrate-{}", std::process::id());
    let v: api::VolumeInfo = c.post(
        "/v1/volumes",
        &api::CreateVolume {
            name: name.clone(),
            size: a.size,
            datastore: Some(a.datastore.clone()),
            policy: Some("uncached".into()),
            ..Default::default()
        },
    )?;
    let result = (|| -> anyhow::Result<api::Calibration> {
        let uri = v
            .urls
            .first()
            .ok_or_else(|| anyhow!("vestad has no NBD listener enabled; set [nbd] unix or tcp"))?
            .clone();
        let started = Instant::now();
        let mut experiments = Vec::with_capacity(grid.len());
        for (i, ch) in grid.iter().enumerate() {
            let latency_ms = run_fio(&uri, ch, a.runtime_s)
                .with_context(|| format!("experiment {} of {}", i + 1, grid.len()))?;
            eprintln!(
                "[{}/{}] OIO {:>2}, {:>3} KiB, {:>3} % read, {:>3} % random: {latency_ms:.2} ms \
                 ({:.0} s elapsed)",
                i + 1,
                grid.len(),
                ch.oio,
                ch.io_size_kib,
                ch.read_pct,
                ch.random_pct,
                started.elapsed().as_secs_f64()
            );
            experiments.push(Experiment {
                characteristics: *ch,
                latency_ms,
            });
        }
        let fit = workload::calibrate(&experiments)
            .map_err(|e| anyhow!("the sweep does not fit the workload model: {e}"))?;
        Ok(api::Calibration {
            datastore: a.datastore.clone(),
            at_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            constants: fit.constants,
            experiments: experiments.len(),
            median_relative_error: fit.median_relative_error,
            insensitive: ["OIO", "size", "read", "random"]
                .iter()
                .zip(fit.insensitive)
                .filter(|(_, flat)| *flat)
                .map(|(n, _)| n.to_string())
                .collect(),
        })
    })();
    let cleanup: anyhow::Result<api::VolumeInfo> =
        c.delete(&format!("/v1/volumes/{name}?force=true"));
    let cal = result?;
    if let Err(e) = cleanup {
        eprintln!("vesta: could not delete the scratch volume {name}: {e:#}");
    }
    let stored: api::Calibration = c.put("/v1/calibration", &cal)?;
    if a.json {
        return crate::print_json(&stored);
    }
    let k = &stored.constants;
    println!(
        "calibrated on {} with {} experiments: K1 {:.2}, K2 {:.1}, K3 {:.3}, K4 {:.3}; \
         median error {:.0} %. Stored; the models use them from now on.",
        stored.datastore,
        stored.experiments,
        k.k1,
        k.k2,
        k.k3,
        k.k4,
        100.0 * stored.median_relative_error
    );
    if !stored.insensitive.is_empty() {
        println!(
            "the datastore's latency did not respond to: {} (those no longer weigh in a load)",
            stored.insensitive.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_grid_gives_every_constant_pairs() {
        // A synthetic device that follows the model exactly: the fit must recover it from the
        // short grid alone.
        let k = balance::Constants {
            k1: 6.0,
            k2: 100.0,
            k3: 0.2,
            k4: 0.3,
        };
        let exps: Vec<Experiment> = short_grid()
            .into_iter()
            .map(|c| Experiment {
                characteristics: c,
                latency_ms: k.load(&c) / 500.0,
            })
            .collect();
        let fit = workload::calibrate(&exps).unwrap();
        let got = fit.constants;
        for (a, b) in [
            (got.k1, k.k1),
            (got.k2, k.k2),
            (got.k3, k.k3),
            (got.k4, k.k4),
        ] {
            assert!((a - b).abs() < 1e-6 * b.max(1.0), "{got:?} vs {k:?}");
        }
        assert!(fit.pairs.iter().all(|&p| p >= 6), "{:?}", fit.pairs);
    }

    #[test]
    fn fio_latency_is_weighted_by_ios() {
        let j: serde_json::Value = serde_json::from_str(
            r#"{"jobs":[{"read":{"total_ios":300,"lat_ns":{"mean":2000000}},
                          "write":{"total_ios":100,"lat_ns":{"mean":6000000}}}]}"#,
        )
        .unwrap();
        assert!((fio_mean_latency_ms(&j).unwrap() - 3.0).abs() < 1e-9);
        let none: serde_json::Value = serde_json::from_str(
            r#"{"jobs":[{"read":{"total_ios":0,"lat_ns":{"mean":0}},
                          "write":{"total_ios":0,"lat_ns":{"mean":0}}}]}"#,
        )
        .unwrap();
        assert!(fio_mean_latency_ms(&none).is_err());
    }
}
