//! The tools' command-line contract: the tracing subscriber, help and version on
//! standard output, errors as one line on standard error.

use std::ffi::OsString;

/// Exit status of a command line that could not be parsed (as clap and sysexits'
/// `EX_USAGE` family use it).
pub const USAGE_EXIT: i32 = 2;
/// Exit status of a run that failed.
pub const FAILURE_EXIT: i32 = 1;

/// Installs the subscriber that shows the libraries' `tracing` events on standard
/// error: the filter `RUST_LOG` gives (e.g. `RUST_LOG=nixl=debug`), else warnings and
/// errors. Call once, first thing in `main`; a second call leaves the first in place.
pub fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Why a command line ends the program before it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// `--help` or `--version`: this text goes to standard output, exit status 0.
    Print(String),
    /// A wrong invocation: one line for standard error, exit status [`USAGE_EXIT`].
    Usage(String),
}

impl Stop {
    /// Prints what the stop says where it belongs and exits with its status;
    /// `program` prefixes an error line.
    pub fn exit(self, program: &str) -> ! {
        match self {
            Stop::Print(text) => {
                print!("{text}");
                if !text.ends_with('\n') {
                    println!();
                }
                std::process::exit(0)
            }
            Stop::Usage(line) => {
                eprintln!("{program}: {line}");
                std::process::exit(USAGE_EXIT)
            }
        }
    }
}

/// A clap error as a [`Stop`]: help and version text as they are; an error as one line,
/// its first line with clap's tips and context folded in, ending with where the full
/// usage is (`see 'PROGRAM --help'`).
pub fn stop_of(err: &clap::Error, program: &str) -> Stop {
    use clap::error::ErrorKind;
    let text = err.render().to_string();
    match err.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => Stop::Print(text),
        // No command given: clap renders the whole help as the error; one line names
        // the commands instead.
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => Stop::Usage(format!(
            "a command is required: {}; see '{program} --help'",
            commands_of_help(&text).join(", ")
        )),
        _ => Stop::Usage(one_line(&text, program)),
    }
}

/// The command names a rendered help lists under `Commands:` (without `help`).
fn commands_of_help(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with(' '))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(String::from)
        .collect()
}

/// Folds clap's rendered error (`error: …`, indented tips, a usage block) into one line.
fn one_line(rendered: &str, program: &str) -> String {
    let mut lines = rendered.lines();
    let first = lines
        .next()
        .unwrap_or_default()
        .trim()
        .trim_start_matches("error:")
        .trim()
        .to_string();
    let mut parts = vec![first];
    // Tips and context come before the usage block, which the last part replaces.
    for line in lines.map(str::trim) {
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        if !line.is_empty() {
            parts.push(line.to_string());
        }
    }
    format!("{}; see '{program} --help'", parts.join("; "))
}

/// Parses `args` (with the program name first) into `P`, or the [`Stop`] it asks for.
pub fn try_parse<P, I, T>(program: &str, args: I) -> Result<P, Stop>
where
    P: clap::Parser,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    P::try_parse_from(args).map_err(|e| stop_of(&e, program))
}

/// [`try_parse`] of this process's arguments; help, version and errors end the process
/// as [`Stop::exit`] says.
pub fn parse_or_exit<P: clap::Parser>(program: &str) -> P {
    try_parse(program, std::env::args_os()).unwrap_or_else(|stop| stop.exit(program))
}

/// Ends a failed run: `program: message` on standard error (one line: a message of
/// several lines is joined), exit status [`FAILURE_EXIT`].
pub fn fail(program: &str, message: impl std::fmt::Display) -> ! {
    let message = message.to_string();
    let line: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    eprintln!("{program}: {}", line.join("; "));
    std::process::exit(FAILURE_EXIT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    #[command(name = "t", version)]
    struct T {
        /// A number.
        #[arg(long = "num_iter", value_parser = clap::value_parser!(u32).range(1..))]
        num_iter: Option<u32>,
        #[arg(long, value_parser = ["READ", "WRITE"])]
        op: Option<String>,
    }

    #[test]
    fn help_and_version_print() {
        match try_parse::<T, _, _>("t", ["t", "--help"]) {
            Err(Stop::Print(text)) => assert!(text.contains("--num_iter"), "{text}"),
            other => panic!("{other:?}"),
        }
        match try_parse::<T, _, _>("t", ["t", "--version"]) {
            Err(Stop::Print(text)) => assert!(text.starts_with("t "), "{text}"),
            other => panic!("{other:?}"),
        }
    }

    #[derive(Parser, Debug)]
    #[command(name = "s", subcommand_required = true)]
    struct S {
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(clap::Subcommand, Debug)]
    enum Sub {
        /// First.
        Ping,
        /// Second.
        #[command(name = "rma-bw")]
        RmaBw,
    }

    #[test]
    fn a_missing_command_is_one_line_naming_the_commands() {
        match try_parse::<S, _, _>("s", ["s"]) {
            Err(Stop::Usage(line)) => {
                assert_eq!(line, "a command is required: ping, rma-bw; see 's --help'")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn errors_are_one_line_that_name_the_fix() {
        for (args, want) in [
            (&["t", "--num_iter", "0"][..], "0 is not in 1.."),
            (&["t", "--num_iter", "x"][..], "invalid digit"),
            (&["t", "--nmu_iter", "1"][..], "--num_iter"),
            (&["t", "--op", "FOO"][..], "READ, WRITE"),
            (&["t", "--op"][..], "a value is required"),
        ] {
            match try_parse::<T, _, _>("t", args.iter().copied()) {
                Err(Stop::Usage(line)) => {
                    assert!(!line.contains('\n'), "{line}");
                    assert!(line.contains(want), "{args:?}: {line}");
                    assert!(line.ends_with("see 't --help'"), "{line}");
                    assert!(!line.starts_with("error"), "{line}");
                }
                other => panic!("{args:?}: {other:?}"),
            }
        }
    }
}
