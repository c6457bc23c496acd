//! Placeholder until the soft-RoCE guest lands (being written now).
use anyhow::{bail, Result};
pub fn run(_args: &[String]) -> Result<i32> {
    bail!("rxe: not built yet")
}
