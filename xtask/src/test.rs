use anyhow::{bail, Result};
pub fn run(_args: &[String]) -> Result<i32> {
    bail!("test: not built yet")
}
