use anyhow::{bail, Result};
pub fn run(_args: &[String]) -> Result<i32> {
    bail!("bindgen: not built yet")
}
