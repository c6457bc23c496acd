//! Proof of the sender inside every notification message and every rail control message:
//! a MAC under a key only the two agents of a pair hold, and a sequence number against
//! replays.
//!
//! What is sealed: every message a LIBFABRIC backend sends on its rails to a peer —
//! notifications ([`Sealer::seal`]); the staging pipeline's OFFER, FETCH and DONE
//! (`backends::staging`, sent through `stage_net`); READ assist requests and their answers
//! (module `assist`); direct VRAM copy requests and their answers (module `peer_copy`)
//! ([`Sealer::seal_control`], [`ControlFrame`]). Answers are sealed by the serving side,
//! so only the peer a request went to can say it is done. Not sealed, and attributed by
//! the provider alone (module `sources`): remote CQ data (a notified WRITE's key, a staged
//! FETCH's token), which carries 64 bits and nothing else.
//!
//! Why: the transport's word on who sent a message (`FI_SOURCE`, module `sources`) is
//! only as strong as the provider's. libfabric 1.17's `shm` misattributes messages of a
//! same-user process that floods the rail (past some thousands of forged messages some
//! were reported as coming from a loaded peer's endpoint: `docs/BENCHMARKS.md`, "load
//! under attack"), so a notification naming a loaded peer must prove itself.
//!
//! How the key comes about, with no handshake to wait for: every backend (every plane of
//! one) draws an X25519 key pair when it opens and advertises the public half in its
//! connection information ([`encode_conn_section`]). Metadata binding (see
//! [`crate::Agent::load_remote_metadata`], "Binding") keeps a loaded name tied to the
//! connection information it first came with, so the public key a side loaded under a
//! name is that agent's. Both sides compute the same Diffie-Hellman secret from their
//! own secret half and the other's public half, and derive one key per direction from
//! it, bound to both names and both public keys (a key for A → B is never valid for
//! B → A). A process that saw both connection informations still lacks both secret
//! halves: it cannot compute the key.
//!
//! The sealed frame is `NXNS seq:u64le tag:[u8; 16] inner`, `inner` being the plain
//! notification (`NXNT…`, [`super::xfer::encode_notif`]) and `tag` the first 16 bytes of
//! HMAC-SHA256 over `seq ‖ inner`. `seq` grows per direction; the receiver keeps the
//! highest it accepted and which of the [`REPLAY_WINDOW`] before it it has seen, so a
//! replayed or duplicated frame is refused while frames overtaken on other rails or
//! threads still count. A new sender key (the sender reloaded the receiver) starts its
//! sequence at the nanoseconds since its backend opened: higher than anything an older
//! key of the same backend sent.
//!
//! What the receiver does with a frame naming a loaded peer (module `worker`): a tag
//! that verifies attributes it to that peer, whatever endpoint the provider names; a tag
//! that does not, a replay, or a plain (unsealed) frame is dropped and counted, never
//! attributed — except where the loaded incarnation's process has ended (its restarted
//! successor seals under a key this side has not loaded yet: a stranger's, as before).
//! Frames naming no loaded peer are judged as before (`notif_senders`). Honest peers
//! never wait for a key: it exists as soon as both have loaded each other, which sending
//! a notification at all needs on the sender's side and attributing it needs on the
//! receiver's.
//!
//! Control messages ([`ControlFrame`]) are sealed under the same key with the same
//! sequence, and opened against the same window: `NXRS seq tag public name inner`. They
//! name their sender in the frame (their inner messages do not) and carry its public key.
//! What the receiver (module `worker`) does with one:
//! - naming a loaded peer whose process has not ended: opened under that peer's key; it
//!   is then that peer's, whatever endpoint the provider names (requests are answered at
//!   the peer's endpoint they name, which must be one of that peer's bound endpoints);
//!   one that does not open (forged, replayed) is dropped and counted
//!   (`LibfabricBackend::unproven_control_messages`), never acted upon;
//! - naming anyone else: opened under the key derived from the public key it carries
//!   ([`Channels`]: a staging target serves initiators it never loaded): a frame that
//!   opens came from the holder of that key's secret, and its answers are sealed under
//!   that key, so that only that holder accepts them; it is then judged as a stranger's
//!   request was before sealing (`notif_senders`, the requester must be the endpoint the
//!   provider names, READ assists and direct copies refused), and one from a live loaded
//!   peer's endpoint naming another is dropped;
//! - plain (a stranger without a key): dropped and counted where the provider names a
//!   live loaded peer's endpoint as its sender (that peer seals everything), else judged
//!   as a stranger's; a plain answer (DONE, FETCHED) is never taken: an answer counts
//!   only when sealed by the peer the request went to. A staged FETCH's data (remote CQ
//!   data: 64 bits, no room for a seal) ends nothing by itself: the FETCH completes on
//!   its target's sealed FETCHED, sent once every write is delivered.
//!
//! Compatibility: connection information without the key section (a peer built before
//! it) is refused at load with [`crate::Error::MetadataRefused`] naming the reason; a
//! peer built before refuses this side's connection information (trailing bytes) the
//! same way. Version 2 of the section means "control messages are sealed too": a peer of
//! version 1 (sealed notifications, plain control messages, which this side drops) and
//! this side refuse each other's connection information at load, with the section's
//! version in the reason. Version 3 means "a staged FETCH is answered with a sealed
//! FETCHED": versions 2 and 3 refuse each other the same way. Nothing is lost silently.

use crate::error::{Error, Result};
use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use x25519_dalek::{PublicKey, StaticSecret};

type HmacSha256 = Hmac<Sha256>;

/// Magic of a sealed notification frame.
pub(super) const SEALED_MAGIC: &[u8; 4] = b"NXNS";
/// Bytes a seal adds to a notification: magic, sequence, tag.
pub(super) const SEAL_OVERHEAD: usize = 4 + 8 + TAG_LEN;
/// Bytes of the truncated HMAC-SHA256 tag.
const TAG_LEN: usize = 16;
/// Tag of the key section of the connection information, then its version.
pub(super) const CONN_TAG: &[u8; 4] = b"NXNK";
/// Version 2: the same key also seals the rail control messages ([`ControlFrame`]); a
/// peer of version 1 sends them plain, which this side drops, so the versions refuse each
/// other at load. Version 3: a staged FETCH completes only on its target's sealed
/// FETCHED answer, which a version-2 target never sends (its requester would wait for
/// it forever, and a version-2 requester would drop it): the versions refuse each other
/// at load.
const CONN_VERSION: u8 = 3;
/// Bytes of the key section: tag, version, X25519 public key.
pub(super) const CONN_WIRE_SIZE: usize = 4 + 1 + 32;
/// Sequence numbers behind the highest accepted one that are still accepted once.
pub(super) const REPLAY_WINDOW: u64 = 4096;
/// How far beyond the highest accepted sequence number a frame may go: a sender's
/// sequence grows by one per frame, and a new sender key of the same backend starts at
/// the nanoseconds since that backend opened, so no genuine frame jumps 2^56 (over two
/// years of nanoseconds). A made-up sequence number (random, most of a forged flood) is
/// then refused without its tag being computed.
pub(super) const MAX_SEQ_JUMP: u64 = 1 << 56;
/// Domain separation of the derived keys.
const KDF_LABEL: &[u8] = b"nixl libfabric notification mac v1";

/// This backend's key pair (one per backend incarnation; the secret never leaves it).
pub(super) struct Identity {
    secret: StaticSecret,
    public: PublicKey,
    /// Sequences of new sender keys start at the nanoseconds since this instant.
    opened: Instant,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("public", &self.public.as_bytes())
            .finish_non_exhaustive()
    }
}

impl Identity {
    /// A fresh key pair from the kernel's secure generator.
    pub(super) fn generate() -> Result<Self> {
        let mut bytes = [0u8; 32];
        crate::os::random_bytes(&mut bytes)?;
        let secret = StaticSecret::from(bytes);
        bytes.fill(0);
        let public = PublicKey::from(&secret);
        Ok(Identity {
            secret,
            public,
            opened: Instant::now(),
        })
    }

    /// The public half, as advertised.
    pub(super) fn public(&self) -> [u8; 32] {
        self.public.to_bytes()
    }

    /// The keys between agent `me` (this identity) and agent `peer` whose public key is
    /// `peer_public`: one to seal what `me` sends, one to open what `peer` sends.
    /// Refused for a public key that yields no shared secret (a low-order point: a
    /// forgery, never a real peer's key).
    pub(super) fn pair(
        &self,
        me: &str,
        peer: &str,
        peer_public: &[u8; 32],
    ) -> Result<(Sealer, Opener)> {
        let theirs = PublicKey::from(*peer_public);
        let shared = self.secret.diffie_hellman(&theirs);
        if !shared.was_contributory() {
            return Err(Error::MetadataRefused {
                agent: peer.to_string(),
                reason: "its notification key is not a valid X25519 public key".into(),
            });
        }
        let derive = |from: &str, to: &str, from_key: &[u8; 32], to_key: &[u8; 32]| {
            let mut kdf =
                HmacSha256::new_from_slice(shared.as_bytes()).expect("HMAC takes keys of any size");
            kdf.update(KDF_LABEL);
            for part in [from.as_bytes(), to.as_bytes()] {
                kdf.update(&(part.len() as u64).to_le_bytes());
                kdf.update(part);
            }
            kdf.update(from_key);
            kdf.update(to_key);
            let key = kdf.finalize().into_bytes();
            HmacSha256::new_from_slice(&key).expect("HMAC takes keys of any size")
        };
        let mine = self.public.to_bytes();
        let start = (self.opened.elapsed().as_nanos() as u64).max(1);
        Ok((
            Sealer {
                mac: derive(me, peer, &mine, peer_public),
                next_seq: AtomicU64::new(start),
                me: me.as_bytes().into(),
                public: mine,
            },
            Opener {
                mac: derive(peer, me, peer_public, &mine),
                window: Mutex::new(ReplayWindow::default()),
            },
        ))
    }
}

/// Seals notifications and rail control messages to one peer (this side → the peer).
pub(super) struct Sealer {
    /// Keyed once: each message clones the keyed state.
    mac: HmacSha256,
    next_seq: AtomicU64,
    /// This side's agent name and public key, which control frames carry.
    me: Box<[u8]>,
    public: [u8; 32],
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer").finish_non_exhaustive()
    }
}

impl Sealer {
    /// `inner` (a plain notification frame) sealed with the next sequence number.
    pub(super) fn seal(&self, inner: &[u8]) -> Vec<u8> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let mut out = Vec::with_capacity(SEAL_OVERHEAD + inner.len());
        out.extend_from_slice(SEALED_MAGIC);
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&tag(&self.mac, seq, inner));
        out.extend_from_slice(inner);
        out
    }

    /// `inner` (a rail control message: staging, READ assist or direct copy, request or
    /// answer) sealed with the next sequence number of the same sequence as the
    /// notifications, naming this side and carrying its public key ([`ControlFrame`]).
    pub(super) fn seal_control(&self, inner: &[u8]) -> Vec<u8> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        ControlFrame {
            sealed: Sealed {
                seq,
                tag: tag(&self.mac, seq, inner),
                inner,
            },
            public: self.public,
            sender: &self.me,
        }
        .encode()
    }
}

/// Opens notifications from one peer (the peer → this side).
pub(super) struct Opener {
    mac: HmacSha256,
    window: Mutex<ReplayWindow>,
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opener").finish_non_exhaustive()
    }
}

/// Why a sealed frame was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The tag does not verify under the key of the peer the frame names.
    BadTag,
    /// Its sequence number was accepted before, or lies behind the window.
    Replayed,
    /// It came without a seal.
    Unsealed,
    /// It names an unloaded sender while [`MAX_CHANNELS`] channels with others are open.
    NoRoom,
    /// It names an unloaded sender under a public key this side has no pair key for yet,
    /// while the key agreements for such keys are over their budget ([`Channels`]).
    Busy,
    /// Its sequence number lies further beyond the highest accepted one than any sender
    /// of that key can have gone ([`MAX_SEQ_JUMP`]): refused before its tag is checked.
    Ahead,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refusal::BadTag => "its MAC does not verify under the named peer's key",
            Refusal::Replayed => "its sequence number was seen before (a replay)",
            Refusal::Unsealed => "it is not sealed",
            Refusal::NoRoom => "too many unloaded senders have channels open",
            Refusal::Busy => "too many new keys at once (key agreements over their budget)",
            Refusal::Ahead => "its sequence number is beyond any its sender can have reached",
        })
    }
}

impl Opener {
    /// Checks a sealed frame's sequence number against the window (a replay, or one no
    /// sender of this key can have reached, is refused without computing its tag), then
    /// its tag, then takes its sequence number (only a frame whose tag verifies moves
    /// the window).
    pub(super) fn open(&self, frame: &Sealed<'_>) -> std::result::Result<(), Refusal> {
        self.window.lock().precheck(frame.seq)?;
        let mut mac = self.mac.clone();
        mac.update(&frame.seq.to_le_bytes());
        mac.update(frame.inner);
        mac.verify_truncated_left(&frame.tag)
            .map_err(|_| Refusal::BadTag)?;
        if self.window.lock().accept(frame.seq) {
            Ok(())
        } else {
            Err(Refusal::Replayed)
        }
    }
}

fn tag(key: &HmacSha256, seq: u64, inner: &[u8]) -> [u8; TAG_LEN] {
    let mut mac = key.clone();
    mac.update(&seq.to_le_bytes());
    mac.update(inner);
    let full = mac.finalize().into_bytes();
    let mut out = [0u8; TAG_LEN];
    out.copy_from_slice(&full[..TAG_LEN]);
    out
}

/// A sealed frame, split (not yet verified).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sealed<'a> {
    pub(super) seq: u64,
    pub(super) tag: [u8; TAG_LEN],
    pub(super) inner: &'a [u8],
}

impl<'a> Sealed<'a> {
    /// Splits a frame that starts with [`SEALED_MAGIC`]; `None` for anything shorter
    /// than a seal or with another magic.
    pub(super) fn split(frame: &'a [u8]) -> Option<Self> {
        let rest = frame.strip_prefix(SEALED_MAGIC)?;
        let (seq, rest) = rest.split_first_chunk::<8>()?;
        let (tag, inner) = rest.split_first_chunk::<TAG_LEN>()?;
        Some(Sealed {
            seq: u64::from_le_bytes(*seq),
            tag: *tag,
            inner,
        })
    }

    /// The frame again (fuzzing: split and encode are inverse).
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(SEAL_OVERHEAD + self.inner.len());
        out.extend_from_slice(SEALED_MAGIC);
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.tag);
        out.extend_from_slice(self.inner);
        out
    }
}

/// Magic of a sealed rail control message.
pub(super) const CONTROL_MAGIC: &[u8; 4] = b"NXRS";
/// Bytes a control seal adds besides the sender's name: magic, sequence, tag, public
/// key, the name's length.
pub(super) const CONTROL_OVERHEAD: usize = SEAL_OVERHEAD + 32 + 2;
/// The longest sender name a control frame carries.
const MAX_SENDER: usize = 1024;

/// A sealed rail control message (not yet verified):
/// `NXRS seq:u64le tag:[u8; 16] public:[u8; 32] name_len:u16le name inner`, `inner`
/// being a plain staging (`NXST`), READ assist (`NXCM`) or direct copy (`NXPV`) message
/// and `tag` the pair key's HMAC over `seq ‖ inner` as for notifications (same key, same
/// sequence and replay window per direction; the inner magics keep the kinds apart).
///
/// Unlike a notification, a control message does not name its sender inside, so the
/// frame does: the receiver opens it under the key of the loaded peer of that name. The
/// sender's public key is there for a receiver that has not loaded the sender (a
/// staging target serves initiators it never loaded): it derives the pair key from its
/// own secret and that key ([`Channels`]), which proves the frame came from whoever
/// holds that key's secret, not which agent it is, and seals its answers under it, so
/// that only the holder of that secret, the initiator whose key it is, accepts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ControlFrame<'a> {
    pub(super) sealed: Sealed<'a>,
    pub(super) public: [u8; 32],
    /// The sender's agent name as sent (bytes: checked as UTF-8 by the receiver).
    pub(super) sender: &'a [u8],
}

impl<'a> ControlFrame<'a> {
    /// Splits a frame that starts with [`CONTROL_MAGIC`]; `None` for anything shorter
    /// than its fields, another magic or a name over [`MAX_SENDER`] bytes.
    pub(super) fn split(frame: &'a [u8]) -> Option<Self> {
        let rest = frame.strip_prefix(CONTROL_MAGIC)?;
        let (seq, rest) = rest.split_first_chunk::<8>()?;
        let (tag, rest) = rest.split_first_chunk::<TAG_LEN>()?;
        let (public, rest) = rest.split_first_chunk::<32>()?;
        let (len, rest) = rest.split_first_chunk::<2>()?;
        let len = usize::from(u16::from_le_bytes(*len));
        if len > MAX_SENDER || rest.len() < len {
            return None;
        }
        let (sender, inner) = rest.split_at(len);
        Some(ControlFrame {
            sealed: Sealed {
                seq: u64::from_le_bytes(*seq),
                tag: *tag,
                inner,
            },
            public: *public,
            sender,
        })
    }

    /// The frame's bytes (fuzzing: split and encode are inverse).
    pub(super) fn encode(&self) -> Vec<u8> {
        let name = &self.sender[..self.sender.len().min(MAX_SENDER)];
        let mut out = Vec::with_capacity(CONTROL_OVERHEAD + name.len() + self.sealed.inner.len());
        out.extend_from_slice(CONTROL_MAGIC);
        out.extend_from_slice(&self.sealed.seq.to_le_bytes());
        out.extend_from_slice(&self.sealed.tag);
        out.extend_from_slice(&self.public);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(self.sealed.inner);
        out
    }
}

/// Pair keys with senders of control frames this side has not loaded (or whose loaded
/// incarnation's process ended), by (agent name, public key): each opens that sender's
/// frames (with a replay window of its own) and seals the answers to it.
///
/// Bounded: at most [`MAX_CHANNELS`] at once, each kept only once a frame opened under
/// it. A new one beyond that first drops the channels of names loaded since (their frames
/// go through the loaded peer's key now); if none can go, the frame is refused. Never
/// evicting a channel that may still be in use keeps its replay window: a recorded frame
/// of an evicted channel would open again under a fresh one. (A same-user process that
/// makes that many key pairs of its own can so keep senders this side has not loaded
/// from being served; loading them is the remedy.)
///
/// Junk costs little: the pair key of a sender whose frame did not open is kept among
/// [`MAX_UNPROVEN`] others (more junk under that key costs an HMAC, not another key
/// agreement), and key agreements for keys not seen yet are paced ([`AGREEMENT_BURST`],
/// [`AGREEMENTS_PER_SEC`]): a flood of frames under made-up keys, each of which would
/// cost an X25519 (tens of microseconds, `docs/BENCHMARKS.md`), is refused beyond that
/// pace ([`Refusal::Busy`]) at the cost of a table lookup, so that the rail worker keeps
/// taking messages as fast as they come. The price: while such a flood lasts, the first
/// frame of an unloaded sender with a new key may be refused too (a sender this side
/// loaded is never affected: its frames open under the loaded key).
pub(super) struct Channels {
    identity: Arc<Identity>,
    me: String,
    table: Mutex<ChannelTable>,
    /// Key agreements made (tests: a junk frame under a known key costs none).
    agreements: AtomicU64,
}

#[derive(Default)]
struct ChannelTable {
    /// Channels under which a frame opened.
    open: HashMap<ChannelKey, Arc<Channel>>,
    /// Pair keys of senders none of whose frames opened yet (`None`: a public key that
    /// yields no shared secret).
    unproven: HashMap<ChannelKey, Option<Arc<Channel>>>,
    /// Key agreements left in the burst, and when the last one was earned.
    tokens: u32,
    earned_at: Option<Instant>,
}

/// A channel's sender: its agent name (bytes, as sent) and public key.
type ChannelKey = (Box<[u8]>, [u8; 32]);

/// Most channels with unloaded senders kept at once.
pub(super) const MAX_CHANNELS: usize = 1024;
/// Most pair keys kept for senders none of whose frames opened (then they are forgotten
/// all at once: a sender that is real opens its channel with its first frame).
pub(super) const MAX_UNPROVEN: usize = 256;
/// Key agreements with new keys allowed at once...
pub(super) const AGREEMENT_BURST: u32 = 64;
/// ...and on average per second after that: at most a few percent of a core.
pub(super) const AGREEMENTS_PER_SEC: u32 = 1000;

/// The keys between this side and one unloaded sender.
#[derive(Debug)]
pub(super) struct Channel {
    pub(super) sealer: Arc<Sealer>,
    pub(super) opener: Opener,
}

impl std::fmt::Debug for Channels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channels")
            .field("open", &self.table.lock().open.len())
            .finish_non_exhaustive()
    }
}

impl ChannelTable {
    /// Takes one key agreement of the budget at `now` (false: over the budget).
    fn take_agreement(&mut self, now: Instant) -> bool {
        let every = Duration::from_secs(1) / AGREEMENTS_PER_SEC;
        match self.earned_at {
            None => {
                self.tokens = AGREEMENT_BURST;
                self.earned_at = Some(now);
            }
            Some(at) => {
                let earned = now.saturating_duration_since(at).as_nanos() / every.as_nanos();
                if earned > 0 {
                    let earned = u32::try_from(earned).unwrap_or(u32::MAX);
                    self.tokens = self.tokens.saturating_add(earned).min(AGREEMENT_BURST);
                    // A full bucket earns nothing more; otherwise the fraction carries.
                    self.earned_at = Some(if self.tokens == AGREEMENT_BURST {
                        now
                    } else {
                        at + every * earned
                    });
                }
            }
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

impl Channels {
    pub(super) fn new(identity: Arc<Identity>, me: &str) -> Self {
        Channels {
            identity,
            me: me.to_string(),
            table: Mutex::default(),
            agreements: AtomicU64::new(0),
        }
    }

    /// This backend's key pair.
    pub(super) fn identity(&self) -> &Arc<Identity> {
        &self.identity
    }

    /// Key agreements made so far.
    #[cfg(test)]
    pub(super) fn agreements(&self) -> u64 {
        self.agreements.load(Ordering::Relaxed)
    }

    /// The channel with the sender of `frame` (made on first use), and the frame opened
    /// under it. `is_loaded`: whether a name is now loaded (such channels may go when
    /// the table is full).
    pub(super) fn open(
        &self,
        frame: &ControlFrame<'_>,
        is_loaded: impl Fn(&str) -> bool,
    ) -> std::result::Result<Arc<Channel>, Refusal> {
        self.open_at(frame, is_loaded, Instant::now())
    }

    /// [`open`](Self::open) at `now` (the agreement budget's clock).
    pub(super) fn open_at(
        &self,
        frame: &ControlFrame<'_>,
        is_loaded: impl Fn(&str) -> bool,
        now: Instant,
    ) -> std::result::Result<Arc<Channel>, Refusal> {
        let sender = std::str::from_utf8(frame.sender).map_err(|_| Refusal::BadTag)?;
        let key = (Box::<[u8]>::from(frame.sender), frame.public);
        let mut table = self.table.lock();
        if let Some(channel) = table.open.get(&key).cloned() {
            drop(table);
            channel.opener.open(&frame.sealed)?;
            return Ok(channel);
        }
        if table.open.len() >= MAX_CHANNELS {
            table
                .open
                .retain(|(name, _), _| !std::str::from_utf8(name).is_ok_and(&is_loaded));
            if table.open.len() >= MAX_CHANNELS {
                return Err(Refusal::NoRoom);
            }
        }
        let channel = match table.unproven.get(&key) {
            Some(None) => return Err(Refusal::BadTag),
            Some(Some(channel)) => channel.clone(),
            None => {
                if !table.take_agreement(now) {
                    return Err(Refusal::Busy);
                }
                self.agreements.fetch_add(1, Ordering::Relaxed);
                let channel = self
                    .identity
                    .pair(&self.me, sender, &frame.public)
                    .ok()
                    .map(|(sealer, opener)| {
                        Arc::new(Channel {
                            sealer: Arc::new(sealer),
                            opener,
                        })
                    });
                if table.unproven.len() >= MAX_UNPROVEN {
                    table.unproven.clear();
                }
                table.unproven.insert(key.clone(), channel.clone());
                channel.ok_or(Refusal::BadTag)?
            }
        };
        // Kept only once a frame opened under it: junk under made-up keys takes no room.
        channel.opener.open(&frame.sealed)?;
        table.unproven.remove(&key);
        table.open.insert(key, channel.clone());
        Ok(channel)
    }
}

/// The highest sequence number accepted and which of the [`REPLAY_WINDOW`] before it
/// were seen (bit `i` of the map: `highest - i`).
#[derive(Debug, Default)]
struct ReplayWindow {
    highest: u64,
    seen: Vec<u64>,
}

impl ReplayWindow {
    const WORDS: usize = (REPLAY_WINDOW / 64) as usize;

    /// Refuses, without marking anything, a sequence number [`accept`](Self::accept)
    /// would refuse, and one more than [`MAX_SEQ_JUMP`] beyond the highest accepted.
    fn precheck(&self, seq: u64) -> std::result::Result<(), Refusal> {
        if seq == 0 {
            return Err(Refusal::Replayed);
        }
        if self.highest > 0 && seq > self.highest.saturating_add(MAX_SEQ_JUMP) {
            return Err(Refusal::Ahead);
        }
        if seq > self.highest {
            return Ok(());
        }
        let back = self.highest - seq;
        if back >= REPLAY_WINDOW {
            return Err(Refusal::Replayed);
        }
        let (word, bit) = ((back / 64) as usize, back % 64);
        match self.seen.get(word) {
            Some(w) if w & (1 << bit) != 0 => Err(Refusal::Replayed),
            _ => Ok(()),
        }
    }

    /// Whether `seq` is new (then it is marked seen). Sequence 0 is never a sender's.
    fn accept(&mut self, seq: u64) -> bool {
        if self.seen.is_empty() {
            self.seen = vec![0; Self::WORDS];
        }
        if seq == 0 {
            return false;
        }
        if seq > self.highest {
            let shift = seq - self.highest;
            self.shift(shift);
            self.highest = seq;
            self.seen[0] |= 1;
            return true;
        }
        let back = self.highest - seq;
        if back >= REPLAY_WINDOW {
            return false;
        }
        let (word, bit) = ((back / 64) as usize, back % 64);
        if self.seen[word] & (1 << bit) != 0 {
            return false;
        }
        self.seen[word] |= 1 << bit;
        true
    }

    /// Moves the map `by` sequence numbers forward (bit i → bit i + by).
    fn shift(&mut self, by: u64) {
        if by >= REPLAY_WINDOW {
            self.seen.fill(0);
            return;
        }
        let (words, bits) = ((by / 64) as usize, (by % 64) as u32);
        for i in (0..Self::WORDS).rev() {
            let from = i.checked_sub(words);
            let low = from.map_or(0, |j| self.seen[j]);
            let carry = from
                .and_then(|j| j.checked_sub(1))
                .map_or(0, |j| self.seen[j]);
            self.seen[i] = if bits == 0 {
                low
            } else {
                (low << bits) | (carry >> (64 - bits))
            };
        }
    }
}

/// Appends the key section (`NXNK ver public:[u8; 32]`) to connection information.
pub(super) fn encode_conn_section(out: &mut Vec<u8>, public: &[u8; 32]) {
    out.extend_from_slice(CONN_TAG);
    out.push(CONN_VERSION);
    out.extend_from_slice(public);
}

/// Decodes a key section ([`encode_conn_section`]); `bytes` is exactly the section.
pub(super) fn decode_conn_section(bytes: &[u8]) -> std::result::Result<[u8; 32], String> {
    if bytes.len() != CONN_WIRE_SIZE || !bytes.starts_with(CONN_TAG) {
        return Err("bad notification key section".into());
    }
    if bytes[4] != CONN_VERSION {
        return Err(format!(
            "notification key section version {} (this build reads {CONN_VERSION})",
            bytes[4]
        ));
    }
    let mut public = [0u8; 32];
    public.copy_from_slice(&bytes[5..]);
    Ok(public)
}

/// Fuzzing entry point (not a stable API): splits `input` as a sealed frame and opens it
/// under a fixed pair key, twice (the second must be a replay), and feeds the replay
/// window the sequence numbers its 8-byte words name. Returns whether split and encode
/// agree and the window behaved (decoding itself must never panic).
#[doc(hidden)]
pub fn fuzz_sealed_notif(input: &[u8]) -> bool {
    use std::sync::OnceLock;
    static PAIR: OnceLock<(Sealer, Opener)> = OnceLock::new();
    let (sealer, opener) = PAIR.get_or_init(|| {
        let a = Identity::fixed(1);
        let b = Identity::fixed(2);
        let (sealer, _) = a.pair("a", "b", &b.public()).expect("valid keys");
        let (_, opener) = b.pair("b", "a", &a.public()).expect("valid keys");
        (sealer, opener)
    });
    let mut ok = true;
    if let Some(frame) = Sealed::split(input) {
        ok &= frame.encode() == input;
        // A fresh window: a forged tag never verifies; a verified one is a replay the
        // second time.
        let fresh = Opener {
            mac: opener.mac.clone(),
            window: Mutex::new(ReplayWindow::default()),
        };
        if fresh.open(&frame).is_ok() {
            ok &= fresh.open(&frame) == Err(Refusal::Replayed);
        }
    }
    // Sealing what was given opens exactly once.
    let sealed = sealer.seal(input);
    let frame = Sealed::split(&sealed).expect("a seal splits");
    let fresh = Opener {
        mac: opener.mac.clone(),
        window: Mutex::new(ReplayWindow::default()),
    };
    ok &= fresh.open(&frame).is_ok() && fresh.open(&frame) == Err(Refusal::Replayed);
    // The window against a model: accepted iff new and within the window.
    let mut window = ReplayWindow::default();
    let mut accepted = std::collections::BTreeSet::new();
    for word in input.chunks_exact(8).take(64) {
        let seq = u64::from_le_bytes(word.try_into().expect("8")) % (4 * REPLAY_WINDOW);
        let highest = accepted.last().copied().unwrap_or(0);
        let expect = seq != 0
            && !accepted.contains(&seq)
            && (seq > highest || highest - seq < REPLAY_WINDOW);
        ok &= window.accept(seq) == expect;
        if expect {
            accepted.insert(seq);
        }
    }
    ok
}

/// Fuzzing entry point (not a stable API): splits `input` as a sealed control frame and
/// opens it under a fixed pair key and as a channel (a forged tag never opens; one that
/// opens is a replay the second time), and seals `input` as a control message, which must
/// split back, open once under the pair key and once as a channel of a receiver that
/// never loaded the sender, whose sealed answer the sender opens. Returns whether all
/// held (decoding itself must never panic).
#[doc(hidden)]
pub fn fuzz_sealed_control(input: &[u8]) -> bool {
    use std::sync::OnceLock;
    /// The pair, and `b`'s channels: one for fuzzed frames (past [`AGREEMENT_BURST`]
    /// new keys, paced: most are then refused without a Diffie-Hellman, which keeps the
    /// fuzzer fast) and one for `a`'s seals (one channel, whose window takes each fresh
    /// sequence number once).
    type Keys = (Sealer, Opener, Opener, Channels, Channels);
    static KEYS: OnceLock<Keys> = OnceLock::new();
    let (a_seal, a_open, b_open, fuzzed, from_a) = KEYS.get_or_init(|| {
        let a = Identity::fixed(1);
        let b = Arc::new(Identity::fixed(2));
        let (a_seal, a_open) = a.pair("a", "b", &b.public()).expect("valid keys");
        let (_, b_open) = b.pair("b", "a", &a.public()).expect("valid keys");
        let fuzzed = Channels::new(b.clone(), "b");
        (a_seal, a_open, b_open, fuzzed, Channels::new(b, "b"))
    });
    let fresh = |opener: &Opener| Opener {
        mac: opener.mac.clone(),
        window: Mutex::new(ReplayWindow::default()),
    };
    let mut ok = true;
    if let Some(frame) = ControlFrame::split(input) {
        ok &= frame.encode() == input;
        let loaded = fresh(b_open);
        if loaded.open(&frame.sealed).is_ok() {
            ok &= loaded.open(&frame.sealed) == Err(Refusal::Replayed);
        }
        if fuzzed.open(&frame, |_| false).is_ok() {
            ok &= fuzzed.open(&frame, |_| false).map(drop) == Err(Refusal::Replayed);
        }
    }
    let sealed = a_seal.seal_control(input);
    let Some(frame) = ControlFrame::split(&sealed) else {
        return false;
    };
    ok &= frame.sender == b"a" && frame.sealed.inner == input && frame.encode() == sealed;
    let loaded = fresh(b_open);
    ok &=
        loaded.open(&frame.sealed).is_ok() && loaded.open(&frame.sealed) == Err(Refusal::Replayed);
    match from_a.open(&frame, |_| false) {
        Ok(channel) => {
            ok &= from_a.open(&frame, |_| false).map(drop) == Err(Refusal::Replayed);
            let answer = channel.sealer.seal_control(b"NXST answer");
            ok &=
                ControlFrame::split(&answer).is_some_and(|f| fresh(a_open).open(&f.sealed).is_ok());
        }
        Err(_) => ok = false,
    }
    ok
}

impl Identity {
    /// A deterministic identity (tests and fuzzing only: its secret is no secret).
    fn fixed(seed: u8) -> Self {
        let secret = StaticSecret::from([seed; 32]);
        let public = PublicKey::from(&secret);
        Identity {
            secret,
            public,
            opened: Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests;
