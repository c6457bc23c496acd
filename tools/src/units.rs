//! Byte sizes: parsed with binary suffixes, printed as short labels.

/// Parses a byte count: a plain number, or one with a binary suffix (`K`, `M`, `G`, `T`,
/// optionally followed by `B` or `iB`, any case: all powers of 1024, as `fi_pingpong`'s
/// `-S 4k` and NIXL's documented defaults `4KiB`, `64MiB`, `8GiB`).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let lower = t.to_ascii_lowercase();
    let digits_end = lower
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(lower.len());
    let (num, suffix) = lower.split_at(digits_end);
    let shift = match suffix {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "`{t}` is not a size: a number of bytes, optionally with K, M, G or T"
            ))
        }
    };
    let n: u64 = num.parse().map_err(|_| {
        format!("`{t}` is not a size: a number of bytes, optionally with K, M, G or T")
    })?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{t}` does not fit in 64 bits"))
}

/// [`parse_size`] as a `usize` (what buffers are measured in).
pub fn parse_size_usize(text: &str) -> Result<usize, String> {
    let n = parse_size(text)?;
    usize::try_from(n).map_err(|_| format!("`{text}` is larger than this machine's address space"))
}

/// A short label for a byte count: `512`, `4K`, `64K`, `1M`, `1.5M`, `8G` (powers of
/// 1024; one decimal, cut rather than rounded, where the count is not a whole number of
/// the unit, so no label reads as a whole number it is not).
pub fn size_label(bytes: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "T"), (30, "G"), (20, "M"), (10, "K")];
    for (shift, unit) in UNITS {
        let base = 1u64 << shift;
        if bytes >= base {
            if bytes.is_multiple_of(base) {
                return format!("{}{unit}", bytes / base);
            }
            let tenths = u128::from(bytes) * 10 / u128::from(base);
            return format!("{}.{}{unit}", tenths / 10, tenths % 10);
        }
    }
    bytes.to_string()
}

/// A human figure of bytes for messages: `8 GiB`, `64 MiB`, `1.5 GiB`, `512 bytes`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
    for (shift, unit) in UNITS {
        let base = 1u64 << shift;
        if bytes >= base {
            let value = bytes as f64 / base as f64;
            return if bytes.is_multiple_of(base) {
                format!("{} {unit}", bytes / base)
            } else {
                format!("{value:.1} {unit}")
            };
        }
    }
    format!("{bytes} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("8gb"), Ok(8 << 30));
        assert_eq!(parse_size(" 1T "), Ok(1 << 40));
        assert_eq!(parse_size("34359738368"), Ok(32 << 30));
        assert_eq!(parse_size("10000000000000"), Ok(10_000_000_000_000));
        for bad in ["", "K", "4X", "-1", "1.5M", "0x10", "4 K"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("20000000T").unwrap_err().contains("64 bits"));
    }

    #[test]
    fn labels_are_short_and_distinct() {
        assert_eq!(size_label(0), "0");
        assert_eq!(size_label(512), "512");
        assert_eq!(size_label(4096), "4K");
        assert_eq!(size_label(65536), "64K");
        assert_eq!(size_label(1 << 20), "1M");
        assert_eq!(size_label(3 << 19), "1.5M");
        assert_eq!(size_label(64 << 20), "64M");
        assert_eq!(size_label(8 << 30), "8G");
        assert_eq!(size_label(1000), "1000");
        assert_eq!(size_label(1_048_575), "1023.9K");
        assert_eq!(size_label(4097), "4.0K");
        // Every power of two from 1 B to 1 TiB gets its own label.
        let labels: Vec<String> = (0..=40).map(|p| size_label(1 << p)).collect();
        let mut unique = labels.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), labels.len(), "{labels:?}");
    }

    #[test]
    fn human_figures() {
        assert_eq!(human_bytes(8 << 30), "8 GiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(100), "100 bytes");
    }
}
