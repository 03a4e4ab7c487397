//! After the fact: did two hosts ever write one range of a datastore at the same time?
//!
//! Every host reaches the LUN through its own nbdkit "door" on the same image
//! ([`crate::Nbdkit::door`]), whose log filter records each request with the moment it
//! arrived and the moment it returned. [`parse`] reads such a log; [`overlaps`] lists the
//! writes (WRITE, WRITE_ZEROES, TRIM) of different hosts to a range whose service intervals
//! overlap. The vault lock and the lease fence are what should make that list empty (DESIGN
//! §4); this checks what actually reached the datastore, whatever the daemons believed.

use std::collections::HashMap;
use std::ops::Range;

/// One request a door served.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub host: String,
    pub op: String,
    pub offset: u64,
    pub count: u64,
    /// Seconds (since 1970, from the log's wall-clock stamps) it arrived and returned. A
    /// request that never returned ends when its connection or its nbdkit ended, or at the
    /// log's last line: until then it may still have reached the image.
    pub start: f64,
    pub end: f64,
}

/// The requests that change data, from one door's log (`logappend=true`: several nbdkit
/// lives, each starting with a `Ready` line).
pub fn parse(host: &str, log: &str) -> Vec<Request> {
    let mut done = Vec::new();
    // (connection, id) -> request still in flight.
    let mut open: HashMap<(u64, u64), Request> = HashMap::new();
    let mut last = 0.0;
    let close = |open: &mut HashMap<(u64, u64), Request>,
                 done: &mut Vec<Request>,
                 at: f64,
                 conn: Option<u64>| {
        let keys: Vec<(u64, u64)> = open
            .keys()
            .filter(|(c, _)| conn.is_none_or(|x| x == *c))
            .copied()
            .collect();
        for k in keys {
            let mut r = open.remove(&k).expect("key exists");
            r.end = at;
            done.push(r);
        }
    };
    for line in log.lines() {
        let mut words = line.splitn(3, ' ');
        let (Some(day), Some(time), Some(rest)) = (words.next(), words.next(), words.next()) else {
            continue;
        };
        let Some(at) = stamp(day, time) else {
            continue;
        };
        last = at;
        if rest.starts_with("Ready") {
            // A new nbdkit: whatever the last one had in flight is over.
            close(&mut open, &mut done, at, None);
            continue;
        }
        let Some((conn, what)) = rest
            .strip_prefix("connection=")
            .and_then(|r| r.split_once(' '))
        else {
            continue;
        };
        let Ok(conn) = conn.parse::<u64>() else {
            continue;
        };
        if what.starts_with("Disconnect") {
            close(&mut open, &mut done, at, Some(conn));
        } else if let Some(ret) = what.strip_prefix("...") {
            if let Some(id) = field(ret, "id=").and_then(|v| v.parse().ok()) {
                if let Some(mut r) = open.remove(&(conn, id)) {
                    r.end = at;
                    done.push(r);
                }
            }
        } else {
            let op = what.split(' ').next().unwrap_or("");
            if !matches!(op, "Write" | "Zero" | "Trim") {
                continue;
            }
            let (Some(id), Some(offset), Some(count)) = (
                field(what, "id=").and_then(|v| v.parse().ok()),
                field(what, "offset=").and_then(hex),
                field(what, "count=").and_then(hex),
            ) else {
                continue;
            };
            open.insert(
                (conn, id),
                Request {
                    host: host.to_owned(),
                    op: op.to_owned(),
                    offset,
                    count,
                    start: at,
                    end: f64::INFINITY,
                },
            );
        }
    }
    close(&mut open, &mut done, last, None);
    done
}

/// Writes of different hosts to `range` that were in service at the same time, described.
pub fn overlaps(requests: &[Request], range: Range<u64>) -> Vec<String> {
    let mut rs: Vec<&Request> = requests
        .iter()
        .filter(|r| r.offset < range.end && r.offset + r.count > range.start)
        .collect();
    rs.sort_by(|a, b| a.start.total_cmp(&b.start));
    // Per host, its request that ends last among those started so far.
    let mut latest: HashMap<&str, &Request> = HashMap::new();
    let mut found = Vec::new();
    for r in rs {
        for (h, e) in &latest {
            if *h != r.host && e.end > r.start {
                found.push(format!(
                    "{} {} of {:#x}+{:#x} was in service from {:.6} to {:.6}, when {} began \
                     {} of {:#x}+{:#x} at {:.6}",
                    h,
                    e.op,
                    e.offset,
                    e.count,
                    e.start,
                    e.end,
                    r.host,
                    r.op,
                    r.offset,
                    r.count,
                    r.start
                ));
            }
        }
        let slot = latest.entry(&r.host).or_insert(r);
        if r.end > slot.end {
            *slot = r;
        }
    }
    found
}

fn field<'a>(s: &'a str, name: &str) -> Option<&'a str> {
    s.split(' ').find_map(|w| w.strip_prefix(name))
}

fn hex(v: &str) -> Option<u64> {
    u64::from_str_radix(v.strip_prefix("0x")?, 16).ok()
}

/// `2026-11-24` `03:14:53.515852` as seconds since 1970 (UTC, as nbdkit's log writes it).
fn stamp(day: &str, time: &str) -> Option<f64> {
    let mut d = day.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, dd) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (hh, mm, ss) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    // Days from the civil date (proleptic Gregorian).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + dd - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "\
2026-11-24 03:14:52.990121 Ready thread_model=3
2026-11-24 03:14:53.513795 connection=1 Connect export=\"\" tls=0 size=0x4000000
2026-11-24 03:14:53.515852 connection=1 Write id=1 offset=0x400000 count=0x10000 fua=1 ...
2026-11-24 03:14:53.516399 connection=1 ...Write id=1 return=0
2026-11-24 03:14:53.516469 connection=1 Zero id=2 offset=0x500000 count=0x10000 trim=0 fua=1 fast=0 ...
2026-11-24 03:14:53.516582 connection=1 ...Zero id=2 return=0
2026-11-24 03:14:53.516657 connection=1 Flush id=3 ...
2026-11-24 03:14:53.516747 connection=1 ...Flush id=3 return=0
2026-11-24 03:14:54.000000 connection=1 Write id=4 offset=0x600000 count=0x1000 fua=0 ...
2026-11-24 03:14:55.000000 connection=1 Disconnect transactions=4
2026-11-24 03:14:56.000000 Ready thread_model=3
2026-11-24 03:14:56.100000 connection=1 Trim id=1 offset=0x700000 count=0x1000 fua=0 ...
";

    #[test]
    fn a_door_log_gives_each_data_request_its_service_interval() {
        let rs = parse("a", A);
        let by_op: Vec<(&str, u64, f64)> = rs
            .iter()
            .map(|r| (r.op.as_str(), r.offset, r.end - r.start))
            .collect();
        assert_eq!(rs.len(), 4, "{rs:?}");
        assert!(by_op.iter().any(|(op, off, d)| *op == "Write"
            && *off == 0x400000
            && (*d - 0.000547).abs() < 1e-5));
        assert!(by_op
            .iter()
            .any(|(op, off, _)| *op == "Zero" && *off == 0x500000));
        // No return: it ends with its connection.
        assert!(by_op
            .iter()
            .any(|(op, off, d)| *op == "Write" && *off == 0x600000 && (*d - 1.0).abs() < 1e-5));
        // The second nbdkit's request is still open at the log's end: it ends there.
        assert!(by_op
            .iter()
            .any(|(op, off, d)| *op == "Trim" && *off == 0x700000 && *d == 0.0));
        assert_eq!(
            stamp("1970-01-02", "00:00:01.5"),
            Some(86_401.5),
            "seconds since 1970"
        );
    }

    #[test]
    fn overlapping_writes_of_two_hosts_are_found_and_only_those() {
        let a = parse("a", A);
        let b_later = "2026-11-24 03:14:57.0 connection=1 Write id=1 offset=0x400000 count=0x1000 fua=0 ...\n\
                       2026-11-24 03:14:57.1 connection=1 ...Write id=1 return=0\n";
        let mut all = a.clone();
        all.extend(parse("b", b_later));
        assert!(overlaps(&all, 0x400000..0x800000).is_empty());
        // b writes while a's unanswered write (03:14:54 until its disconnect) is in service.
        let b_during = b_later
            .replace("03:14:57.0", "03:14:54.5")
            .replace("03:14:57.1", "03:14:54.6");
        let mut all = a.clone();
        all.extend(parse("b", &b_during));
        let found = overlaps(&all, 0x400000..0x800000);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("a Write of 0x600000"), "{found:?}");
        // Outside the range looked at, the same overlap does not count.
        let far: Vec<Request> = all
            .iter()
            .filter(|r| r.host == "b")
            .cloned()
            .chain(a.iter().filter(|r| r.offset != 0x600000).cloned())
            .collect();
        assert!(overlaps(&far, 0x400000..0x800000).is_empty());
        // The same host overlapping itself is just a queue.
        let same: Vec<Request> = parse("a", &b_during).into_iter().chain(a).collect();
        assert!(overlaps(&same, 0x400000..0x800000).is_empty());
    }
}
