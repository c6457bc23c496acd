//! placeholder
#[derive(Debug)]
pub struct VerbsTransport;
