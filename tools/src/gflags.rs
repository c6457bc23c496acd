//! Argument forms as gflags (NIXL's nixlbench) reads them, rewritten into the one form
//! clap parses.
//!
//! gflags takes `--flag value`, `--flag=value` and the same with one dash (`-flag`),
//! treats `-` and `_` in names alike, and reads a boolean as `--x` (true), `--x=true`,
//! `--x=false` (also `1`/`0`, `yes`/`no`, `t`/`f`, `y`/`n`, any case) or `--nox` (false).
//! [`normalize`] rewrites every flag it knows into `--name=value` with the name's
//! underscores: clap then sees `--check_consistency=false` where the user wrote
//! `--check-consistency=false` or `--nocheck_consistency`, and never takes the word after
//! a boolean for its value. Tokens it does not know pass through (with `-` in a `--`
//! name read as `_`, so clap's suggestions name the real flag), and so does everything
//! after `--`.

/// What a flag takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A boolean: bare (`--x`), `--x=BOOL`, or `--nox`.
    Bool,
    /// A value: `--x VALUE` or `--x=VALUE`.
    Value,
}

/// The flags a clap command declares with a long name, and their [`Kind`]: a flag that
/// takes no value, or whose value is optional (`num_args = 0..=1`, as the gflags
/// booleans are declared), is a [`Kind::Bool`]. `--help` and `--version` are left out
/// (they pass through untouched).
pub fn flags_of(command: &clap::Command) -> Vec<(String, Kind)> {
    command
        .get_arguments()
        .filter(|a| {
            !matches!(
                a.get_action(),
                clap::ArgAction::Help
                    | clap::ArgAction::HelpShort
                    | clap::ArgAction::HelpLong
                    | clap::ArgAction::Version
            )
        })
        .filter_map(|a| {
            let takes_value = a.get_action().takes_values();
            let optional = a.get_num_args().is_some_and(|r| r.min_values() == 0);
            let kind = if !takes_value || optional {
                Kind::Bool
            } else {
                Kind::Value
            };
            Some((a.get_long()?.to_string(), kind))
        })
        .collect()
}

/// gflags' boolean values.
pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text.to_ascii_lowercase().as_str() {
        "true" | "t" | "yes" | "y" | "1" => Ok(true),
        "false" | "f" | "no" | "n" | "0" => Ok(false),
        _ => Err(format!("`{text}` is not a boolean: true or false")),
    }
}

/// A name as written, in its canonical form (`_` for `-`).
fn canonical(name: &str) -> String {
    name.replace('-', "_")
}

/// Rewrites `args` (without the program name) as described in the module docs, for a
/// program whose flags are `flags` (canonical names, without dashes). A boolean given a
/// value that is not one is an error; so is `--nox=VALUE`.
pub fn normalize<I, S>(args: I, flags: &[(String, Kind)]) -> Result<Vec<String>, String>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let kind_of = |name: &str| flags.iter().find(|(n, _)| n == name).map(|(_, k)| *k);
    let mut out = Vec::new();
    let mut args = args.into_iter().map(Into::into);
    while let Some(arg) = args.next() {
        if arg == "--" {
            out.push(arg);
            out.extend(args.by_ref());
            break;
        }
        let body = match arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) {
            // Not a flag: "-", a negative number, or a word.
            Some(body) if !body.is_empty() && !body.starts_with(|c: char| c.is_ascii_digit()) => {
                body
            }
            _ => {
                out.push(arg);
                continue;
            }
        };
        let double = arg.starts_with("--");
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (body, None),
        };
        let name = canonical(name);
        match kind_of(&name) {
            Some(Kind::Bool) => {
                let value = match inline {
                    None => true,
                    Some(v) => parse_bool(v).map_err(|e| format!("--{name}={v}: {e}"))?,
                };
                out.push(format!("--{name}={value}"));
            }
            Some(Kind::Value) => match inline {
                Some(v) => out.push(format!("--{name}={v}")),
                // The next word is the value, whatever it looks like (gflags takes
                // `--backend_param -x` the same way); none: clap says one is missing.
                None => match args.next() {
                    Some(v) => out.push(format!("--{name}={v}")),
                    None => out.push(format!("--{name}")),
                },
            },
            None => {
                // `--nox` / `--no_x` / `--no-x` for a boolean `x`.
                let negated = name
                    .strip_prefix("no")
                    .map(|rest| rest.strip_prefix('_').unwrap_or(rest))
                    .filter(|rest| kind_of(rest) == Some(Kind::Bool));
                match (negated, inline) {
                    (Some(flag), None) => out.push(format!("--{flag}=false")),
                    (Some(flag), Some(v)) => {
                        return Err(format!(
                            "--{name}={v}: --{name} takes no value (write --{flag}={v})"
                        ))
                    }
                    // Unknown: clap reports it. A `--` name goes in its canonical form
                    // so that clap's suggestion is the flag meant; `-x` stays as written
                    // (it may be a short option).
                    (None, _) if double => out.push(match inline {
                        Some(v) => format!("--{name}={v}"),
                        None => format!("--{name}"),
                    }),
                    (None, _) => out.push(arg),
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags() -> Vec<(String, Kind)> {
        [
            ("check_consistency", Kind::Bool),
            ("progress", Kind::Bool),
            ("start_block_size", Kind::Value),
            ("backend", Kind::Value),
            ("backend_param", Kind::Value),
        ]
        .iter()
        .map(|(n, k)| (n.to_string(), *k))
        .collect()
    }

    fn norm(line: &str) -> Result<Vec<String>, String> {
        normalize(line.split_whitespace(), &flags())
    }

    fn ok(line: &str) -> String {
        norm(line).unwrap().join(" ")
    }

    #[test]
    fn values_space_equals_and_one_dash() {
        assert_eq!(ok("--start_block_size 4096"), "--start_block_size=4096");
        assert_eq!(ok("--start_block_size=4096"), "--start_block_size=4096");
        assert_eq!(ok("-start_block_size 4096"), "--start_block_size=4096");
        assert_eq!(ok("-start_block_size=4096"), "--start_block_size=4096");
        // The word after a value flag is its value, even when it looks like a flag.
        assert_eq!(ok("--backend_param -x"), "--backend_param=-x");
        assert_eq!(ok("--backend_param a=b=c"), "--backend_param=a=b=c");
        // Missing value: left for clap to report.
        assert_eq!(ok("--backend"), "--backend");
    }

    #[test]
    fn dashes_and_underscores_alike() {
        for line in [
            "--start-block-size 4096",
            "--start_block-size=4096",
            "-start-block_size 4096",
        ] {
            assert_eq!(ok(line), "--start_block_size=4096", "{line}");
        }
        assert_eq!(ok("--check-consistency"), "--check_consistency=true");
    }

    #[test]
    fn gflags_booleans() {
        assert_eq!(ok("--check_consistency"), "--check_consistency=true");
        assert_eq!(ok("-check_consistency"), "--check_consistency=true");
        for t in ["true", "TRUE", "t", "yes", "y", "1"] {
            assert_eq!(
                ok(&format!("--check_consistency={t}")),
                "--check_consistency=true"
            );
        }
        for f in ["false", "False", "f", "no", "n", "0"] {
            assert_eq!(
                ok(&format!("--check_consistency={f}")),
                "--check_consistency=false"
            );
        }
        for line in [
            "--nocheck_consistency",
            "--no_check_consistency",
            "--no-check-consistency",
            "-nocheck_consistency",
        ] {
            assert_eq!(ok(line), "--check_consistency=false", "{line}");
        }
        assert_eq!(ok("--noprogress"), "--progress=false");
        assert_eq!(ok("--no_progress"), "--progress=false");
        // A boolean never takes the next word.
        assert_eq!(
            ok("--check_consistency --backend UCX"),
            "--check_consistency=true --backend=UCX"
        );
        let e = norm("--check_consistency=maybe").unwrap_err();
        assert!(e.contains("true or false"), "{e}");
        let e = norm("--nocheck_consistency=true").unwrap_err();
        assert!(e.contains("takes no value"), "{e}");
    }

    #[test]
    fn unknown_and_special_tokens_pass_through() {
        assert_eq!(ok("--help"), "--help");
        assert_eq!(ok("-h"), "-h");
        assert_eq!(ok("--version"), "--version");
        assert_eq!(ok("-V"), "-V");
        assert_eq!(ok("--max-blok-size 5"), "--max_blok_size 5");
        assert_eq!(ok("--nosuch"), "--nosuch");
        assert_eq!(ok("-5 - word"), "-5 - word");
        assert_eq!(
            ok("-- --check_consistency --start-block-size"),
            "-- --check_consistency --start-block-size"
        );
    }

    #[test]
    fn flags_come_from_the_clap_command() {
        use clap::{Arg, ArgAction, Command};
        let cmd = Command::new("t")
            .arg(Arg::new("a").long("a_b").action(ArgAction::Set))
            .arg(Arg::new("c").long("c").action(ArgAction::SetTrue))
            .arg(
                Arg::new("d")
                    .long("d")
                    .num_args(0..=1)
                    .default_missing_value("true"),
            )
            .arg(Arg::new("e").long("e").action(ArgAction::Append))
            .arg(Arg::new("pos"));
        let mut f = flags_of(&cmd);
        f.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            f,
            [
                ("a_b".to_string(), Kind::Value),
                ("c".to_string(), Kind::Bool),
                ("d".to_string(), Kind::Bool),
                ("e".to_string(), Kind::Value),
            ]
        );
        assert_eq!(parse_bool("Yes"), Ok(true));
        assert!(parse_bool("2").is_err());
    }
}
