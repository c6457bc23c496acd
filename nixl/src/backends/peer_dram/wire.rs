//! The framing of the small request/answer messages same-host peers exchange beside
//! their notifications (direct peer copies, LIBFABRIC's READ assists): a 4-byte magic, a
//! version byte and a kind byte, little-endian fields, names as `u16` length + bytes.
//!
//! Decoding is bounded against hostile input: every read checks what is left, lengths
//! are bounded before anything is taken, and a message must end where its last field
//! does. A malformed message is an `Err` with a short reason to log and drop.

/// Appends `magic | version | kind`.
pub(crate) fn put_header(out: &mut Vec<u8>, magic: &[u8; 4], version: u8, kind: u8) {
    out.extend_from_slice(magic);
    out.push(version);
    out.push(kind);
}

/// Appends `name` with a `u16` length (a name longer than that is cut: names are rail
/// endpoint names and agent names, far shorter, and a decoder bounds them anyway).
pub(crate) fn put_name(out: &mut Vec<u8>, name: &[u8]) {
    let n = name.len().min(usize::from(u16::MAX));
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(&name[..n]);
}

/// Reads a message's fields front to back.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A message that starts with `magic` and `version`: its kind byte and a reader of
    /// what follows; `Err` names `what` the message should have been.
    pub(crate) fn open(
        bytes: &'a [u8],
        magic: &[u8; 4],
        version: u8,
        what: &str,
    ) -> Result<(u8, Self), String> {
        let rest = bytes
            .strip_prefix(magic.as_slice())
            .ok_or_else(|| format!("not a {what} message"))?;
        let mut r = Reader { rest };
        let [v, kind] = r.take::<2>()?;
        if v != version {
            return Err(format!("{what} message version {v}"));
        }
        Ok((kind, r))
    }

    /// The next `N` bytes.
    pub(crate) fn take<const N: usize>(&mut self) -> Result<[u8; N], String> {
        if self.rest.len() < N {
            return Err("truncated".into());
        }
        let (head, tail) = self.rest.split_at(N);
        self.rest = tail;
        let mut out = [0u8; N];
        out.copy_from_slice(head);
        Ok(out)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take::<1>()?[0])
    }

    pub(crate) fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take()?))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take()?))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take()?))
    }

    pub(crate) fn i32(&mut self) -> Result<i32, String> {
        Ok(i32::from_le_bytes(self.take()?))
    }

    /// A name written by [`put_name`]: 1 to `max` bytes.
    pub(crate) fn name(&mut self, max: usize) -> Result<Vec<u8>, String> {
        let n = usize::from(self.u16()?);
        if n == 0 || n > max || self.rest.len() < n {
            return Err("bad reply name".into());
        }
        let (name, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(name.to_vec())
    }

    /// The next `n` bytes (`n` bounded by the caller).
    pub(crate) fn bytes(&mut self, n: usize) -> Result<Vec<u8>, String> {
        if self.rest.len() < n {
            return Err("truncated".into());
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head.to_vec())
    }

    /// The unread bytes.
    pub(crate) fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// The message ends here.
    pub(crate) fn finish(self) -> Result<(), String> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err("trailing bytes".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_and_short_or_long_input_is_refused() {
        let mut out = Vec::new();
        put_header(&mut out, b"TEST", 3, 7);
        out.extend_from_slice(&0xdead_beef_u32.to_le_bytes());
        out.extend_from_slice(&u64::MAX.to_le_bytes());
        put_name(&mut out, b"rail-0");
        let (kind, mut r) = Reader::open(&out, b"TEST", 3, "test").unwrap();
        assert_eq!(kind, 7);
        assert_eq!(r.u32().unwrap(), 0xdead_beef);
        assert_eq!(r.u64().unwrap(), u64::MAX);
        assert_eq!(r.remaining(), 8);
        assert_eq!(r.name(64).unwrap(), b"rail-0");
        r.finish().unwrap();
        // Another magic or version; cut anywhere; a name over its bound; trailing bytes.
        assert!(Reader::open(&out, b"TESX", 3, "test").is_err());
        assert!(Reader::open(&out, b"TEST", 4, "test").is_err());
        for cut in 0..out.len() {
            let read = || -> Result<(), String> {
                let (_, mut r) = Reader::open(&out[..cut], b"TEST", 3, "test")?;
                r.u32()?;
                r.u64()?;
                r.name(64)?;
                r.finish()
            };
            assert!(read().is_err(), "cut at {cut}");
        }
        let (_, mut r) = Reader::open(&out, b"TEST", 3, "test").unwrap();
        r.take::<12>().unwrap();
        assert!(r.name(5).is_err());
        let mut long = out.clone();
        long.push(0);
        let (_, mut r) = Reader::open(&long, b"TEST", 3, "test").unwrap();
        r.take::<12>().unwrap();
        r.name(64).unwrap();
        assert!(r.finish().is_err());
        // An empty name is refused.
        let mut empty = Vec::new();
        put_name(&mut empty, b"");
        let mut r = Reader { rest: &empty };
        assert!(r.name(64).is_err());
    }
}
