//! Mutual authentication of a peer connection (pure: no IO).
//!
//! Every host of a pod knows the pod's peer key (32 random bytes kept by the coordinator).
//! When an owner connects to a peer, each side sends a fresh random nonce and proves it knows
//! the key with an HMAC-SHA256 over both nonces and both host names:
//!
//! 1. owner → peer: `Hello` with the owner's name and nonce `nc`;
//! 2. peer → owner: `Hello` with the peer's name, its nonce `ns` and the peer's proof;
//! 3. owner → peer: `Proof`, the owner's proof, once the peer's checked out;
//! 4. peer → owner: `Reply` Ok, or Failed and the connection closes.
//!
//! The proofs differ by role, so neither side can reflect the other's, and both nonces are in
//! each, so neither can be replayed on another connection. A host outside the pod (or a
//! process that is not a Vesta host at all) gets no further than step 2: nothing it sends
//! reaches a cache log. What follows the handshake is checksummed, not signed: the key keeps
//! out whoever can reach the peer port, not someone who can rewrite the network's packets.

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const NONCE_LEN: usize = 16;
pub const PROOF_LEN: usize = 32;
pub type Nonce = [u8; NONCE_LEN];
pub type Proof = [u8; PROOF_LEN];

/// Which side of the connection a proof comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The host that connected (the volume's owner).
    Owner,
    /// The host that accepted (the peer).
    Peer,
}

/// What both sides of one connection agree they are proving things about.
#[derive(Debug, Clone, Copy)]
pub struct Exchange<'a> {
    pub owner: &'a str,
    pub owner_nonce: &'a Nonce,
    pub peer: &'a str,
    pub peer_nonce: &'a Nonce,
}

/// A pod's peer key.
#[derive(Clone)]
pub struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(…)") // never in a log
    }
}

impl Key {
    pub fn from_bytes(b: [u8; 32]) -> Key {
        Key(b)
    }

    /// 32 bytes from the operating system's random source, for a pod that has no key yet.
    pub fn random_bytes() -> std::io::Result<[u8; 32]> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(std::io::Error::other)?;
        Ok(b)
    }

    fn mac(&self, role: Role, x: &Exchange<'_>) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("any key length");
        m.update(match role {
            Role::Owner => b"vesta peer v2 owner\0",
            Role::Peer => b"vesta peer v2 peer\0\0",
        });
        m.update(x.owner_nonce);
        m.update(x.peer_nonce);
        for name in [x.owner, x.peer] {
            m.update(&(name.len() as u64).to_le_bytes());
            m.update(name.as_bytes());
        }
        m
    }

    /// The proof `role` sends in exchange `x`.
    pub fn prove(&self, role: Role, x: &Exchange<'_>) -> Proof {
        self.mac(role, x).finalize().into_bytes().into()
    }

    /// Whether `proof` is what `role` sends in `x` (compared in constant time).
    pub fn verify(&self, role: Role, x: &Exchange<'_>, proof: &Proof) -> bool {
        self.mac(role, x).verify_slice(proof).is_ok()
    }
}

/// A fresh nonce for one connection.
pub fn nonce() -> std::io::Result<Nonce> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(std::io::Error::other)?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn x<'a>(o: &'a str, on: &'a Nonce, p: &'a str, pn: &'a Nonce) -> Exchange<'a> {
        Exchange {
            owner: o,
            owner_nonce: on,
            peer: p,
            peer_nonce: pn,
        }
    }

    #[test]
    fn a_known_vector() {
        // HMAC-SHA256 of the exchange's bytes, computed independently (Python's hmac module):
        // key 32 × 0x01, "vesta peer v2 owner\0", nonces 16 × 0xaa and 16 × 0xbb, then
        // u64 LE 1 "a" and u64 LE 1 "b".
        let k = Key::from_bytes([1; 32]);
        let p = k.prove(Role::Owner, &x("a", &[0xaa; 16], "b", &[0xbb; 16]));
        let hex: String = p.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5e9f879d5a1280f255d55e7dc217d8034489e6677aedfbb29bacb8b7057c64f0"
        );
    }

    proptest! {
        #[test]
        fn a_proof_checks_out_only_for_its_key_role_nonces_and_names(
            key in any::<[u8; 32]>(),
            other in any::<[u8; 32]>(),
            on in any::<[u8; 16]>(),
            pn in any::<[u8; 16]>(),
            flip in 0usize..16,
            o in "[a-z]{1,8}",
            p in "[a-z]{1,8}",
        ) {
            prop_assume!(key != other);
            let k = Key::from_bytes(key);
            let ex = x(&o, &on, &p, &pn);
            let proof = k.prove(Role::Owner, &ex);
            prop_assert!(k.verify(Role::Owner, &ex, &proof));
            // Another key, the other role, a changed nonce or swapped names: refused.
            prop_assert!(!Key::from_bytes(other).verify(Role::Owner, &ex, &proof));
            prop_assert!(!k.verify(Role::Peer, &ex, &proof));
            let mut on2 = on;
            on2[flip] ^= 1;
            prop_assert!(!k.verify(Role::Owner, &x(&o, &on2, &p, &pn), &proof));
            prop_assert!(!k.verify(Role::Owner, &x(&o, &pn, &p, &on), &proof) || on == pn);
            prop_assert!(!k.verify(Role::Owner, &x(&p, &on, &o, &pn), &proof) || o == p);
            // Names are length-prefixed, so moving a letter between them changes the proof.
            let (o2, p2) = (format!("{o}{}", &p[..1]), p[1..].to_owned());
            prop_assert!(!k.verify(Role::Owner, &x(&o2, &on, &p2, &pn), &proof));
        }
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
