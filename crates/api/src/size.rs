//! Sizes as operators write them: `4096`, `512K`, `10G`, `1.5T`, `20GiB`. Units are binary
//! (K = 1024), as for disks in QEMU and most storage tools.

const UNITS: [(char, u32); 5] = [('K', 10), ('M', 20), ('G', 30), ('T', 40), ('P', 50)];

/// Parses a size; the error says what was wrong and shows an example.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let bad = |why: &str| {
        format!("bad size {s:?}: {why}; write a number with an optional K, M, G, T or P suffix (binary units), e.g. 10G or 512M")
    };
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix('B'))
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(t);
    if t.is_empty() {
        return Err(bad("empty"));
    }
    let (num, shift) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let up = c.to_ascii_uppercase();
            let (_, sh) = UNITS
                .iter()
                .find(|(u, _)| *u == up)
                .ok_or_else(|| bad(&format!("unknown unit {c:?}")))?;
            (&t[..t.len() - 1], *sh)
        }
        _ => (t, 0),
    };
    let num = num.trim();
    if num.is_empty() || !num.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(bad("not a number"));
    }
    if let Some((whole, frac)) = num.split_once('.') {
        let whole: u64 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| bad("not a number"))?
        };
        if frac.is_empty() || frac.len() > 6 || frac.contains('.') {
            return Err(bad("use at most six decimals"));
        }
        let f: u64 = frac.parse().map_err(|_| bad("not a number"))?;
        let scale = 10u64.pow(frac.len() as u32);
        let unit = 1u64 << shift;
        let w = whole.checked_mul(unit).ok_or_else(|| bad("too large"))?;
        let p = (f as u128 * unit as u128 / scale as u128) as u64;
        return w.checked_add(p).ok_or_else(|| bad("too large"));
    }
    let n: u64 = num.parse().map_err(|_| bad("not a number"))?;
    n.checked_mul(1u64 << shift).ok_or_else(|| bad("too large"))
}

/// Formats bytes for people: `10 GiB`, `1.5 MiB`, `512 B`.
pub fn format_size(n: u64) -> String {
    const NAMES: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < NAMES.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else if (v - v.round()).abs() < 0.05 {
        format!("{:.0} {}", v, NAMES[i])
    } else {
        format!("{:.1} {}", v, NAMES[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512K"), Ok(512 << 10));
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("10g"), Ok(10 << 30));
        assert_eq!(parse_size("20GiB"), Ok(20 << 30));
        assert_eq!(parse_size("1.5T"), Ok(3 << 39));
        assert_eq!(parse_size("64MB"), Ok(64 << 20));
        assert_eq!(parse_size(" 1M "), Ok(1 << 20));
    }

    #[test]
    fn rejects_with_an_example() {
        for bad in [
            "",
            "G",
            "10X",
            "ten",
            "1.2.3G",
            "-1G",
            "99999999999P",
            "1.1234567G",
        ] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains("e.g. 10G"), "{bad}: {e}");
        }
    }

    #[test]
    fn formats_for_people() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(10 << 30), "10 GiB");
        assert_eq!(format_size(3 << 19), "1.5 MiB");
    }
}
