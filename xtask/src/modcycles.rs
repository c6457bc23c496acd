//! `cargo xtask modcycles [--crate DIR]...`: import circles between the modules of a
//! crate, so that types several modules share stay in leaf modules (STYLE.md,
//! "Boundaries"). Exit status 1 when a crate has a circle, 0 when none has.
//!
//! Without `--crate`, every library of the workspace is checked (its `lib` target, from
//! `cargo metadata`); `--crate DIR` checks `DIR/src/lib.rs` (or `DIR/src/main.rs`) only,
//! which also reaches a crate outside the workspace such as `python/`.
//!
//! How the graph is built:
//! - **Modules**: the crate root and every module it declares, in files or inline
//!   (`mod x { … }`), following `mod` declarations and `#[path]`. Items under
//!   `#[cfg(test)]` are left out: unit tests may use whatever they test.
//! - **References**: `use` declarations (from `crate::`, `super::`, `self::` or a name the
//!   module defines or declares), and every path in code or types, or in a macro
//!   invocation's tokens, that starts with `crate`, `$crate`, `super` or `self`. Doc
//!   comments and intra-doc links are text, not imports: they are not read.
//! - **Resolution**: a path is followed through `use` imports and re-exports (globs
//!   included) to the module that defines the item, so `crate::QpState` re-exported at the
//!   crate root counts as a use of the module that defines `QpState`; paths into other
//!   crates are dropped. A name the walk cannot find (an item a macro generates) is taken
//!   to live in the module the walk reached.
//! - **Parent and child**: a module that uses its own descendant (`mod x; use x::Y;`) or
//!   an item of its ancestor (`use super::Z;`) follows the tree Rust builds, which is no
//!   circle: such a reference is not an edge. (A parent's re-export is still followed to
//!   the module that defines the item, so `use super::Z` where the parent only re-exports
//!   a sibling's `Z` is an edge to that sibling.)
//! - **Siblings**: any other reference, from module A to module B, is an edge between the
//!   two children of their closest common ancestor that contain A and B. A circle through
//!   submodules (`a::x → b → a::y`) is therefore a circle between the siblings `a` and `b`:
//!   the subtree `a` and the module `b` import each other.
//!
//! Every set of two or more sibling modules that reach each other is reported, each edge
//! with the first reference (file and line) that makes it.

use anyhow::{bail, Context, Result};
use proc_macro2::{Spacing, TokenStream, TokenTree};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use syn::visit::Visit;

const USAGE: &str = "usage: cargo xtask modcycles [--crate DIR]...
  report import circles between sibling modules of each crate (exit 1 if any);
  without --crate: every library of the workspace; --crate DIR: DIR/src/lib.rs";

/// Resolution gives up following re-exports after this many hops (a re-export loop).
const MAX_HOPS: usize = 64;

pub fn run(args: &[String]) -> Result<i32> {
    let mut crate_dirs = Vec::new();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(0);
            }
            "--crate" => match rest.next() {
                Some(dir) => crate_dirs.push(PathBuf::from(dir)),
                None => bail!("--crate needs a folder, e.g. `--crate ibverbs`\n{USAGE}"),
            },
            other => match other.strip_prefix("--crate=") {
                Some(dir) => crate_dirs.push(PathBuf::from(dir)),
                None => bail!("unknown argument `{other}`\n{USAGE}"),
            },
        }
    }
    let root = crate::bindings::workspace_root();
    let crates = if crate_dirs.is_empty() {
        workspace_libraries(&root)?
    } else {
        crate_dirs
            .iter()
            .map(|dir| crate_root_file(&root, dir))
            .collect::<Result<_>>()?
    };
    let mut circles = 0;
    for (name, root_file) in &crates {
        let analysis = analyze(root_file, &FileSystem)
            .with_context(|| format!("reading the modules of {name}"))?;
        print!("{}", analysis.report(name, &root));
        circles += analysis.circles.len();
    }
    Ok(if circles == 0 { 0 } else { 1 })
}

/// `(name, root source file)` of the crate in `dir` (relative to the workspace root or
/// absolute).
fn crate_root_file(root: &Path, dir: &Path) -> Result<(String, PathBuf)> {
    let dir = root.join(dir);
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string());
    ["src/lib.rs", "src/main.rs"]
        .iter()
        .map(|file| dir.join(file))
        .find(|file| file.is_file())
        .map(|file| (name, file))
        .with_context(|| format!("{}: no src/lib.rs or src/main.rs", dir.display()))
}

/// `(package name, lib.rs)` of every workspace package that has a library.
fn workspace_libraries(root: &Path) -> Result<Vec<(String, PathBuf)>> {
    let metadata = crate::test::cargo_metadata(root, &["--no-deps"])?;
    let mut libraries = Vec::new();
    for package in metadata["packages"].as_array().into_iter().flatten() {
        let lib = package["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| {
                t["kind"]
                    .as_array()
                    .is_some_and(|kinds| kinds.iter().any(|k| k == "lib"))
            });
        if let (Some(name), Some(src)) = (
            package["name"].as_str(),
            lib.and_then(|t| t["src_path"].as_str()),
        ) {
            libraries.push((name.to_string(), PathBuf::from(src)));
        }
    }
    libraries.sort();
    Ok(libraries)
}

/// Where source files come from: the file system, or a map in the tests.
pub trait Source {
    fn read(&self, path: &Path) -> Option<String>;
}

struct FileSystem;

impl Source for FileSystem {
    fn read(&self, path: &Path) -> Option<String> {
        std::fs::read_to_string(path).ok()
    }
}

/// A module's path from the crate root (`[]` is the root).
type ModPath = Vec<String>;

/// A path as written: its segments, and whether it starts with `::` (another crate).
#[derive(Debug, Clone)]
struct WrittenPath {
    segments: Vec<String>,
    leading_colon: bool,
}

/// One place where a module names a path.
#[derive(Debug, Clone)]
struct Reference {
    path: WrittenPath,
    file: PathBuf,
    line: usize,
}

#[derive(Debug, Default)]
struct Module {
    children: BTreeSet<String>,
    /// Items defined here (types, functions, macros …), by name.
    defs: BTreeSet<String>,
    /// Names brought in by `use` (and `extern crate`), with the path they stand for.
    imports: Vec<(String, WrittenPath)>,
    globs: Vec<WrittenPath>,
    references: Vec<Reference>,
}

/// The first reference that makes an edge, and how many references make it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Witness {
    pub file: PathBuf,
    pub line: usize,
    pub path: String,
    pub count: usize,
}

/// Siblings (children of `parent`) that reach each other through their imports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Circle {
    pub parent: Vec<String>,
    pub members: Vec<String>,
    /// `(from, to, first reference)` for every edge between two members.
    pub edges: Vec<(String, String, Witness)>,
}

#[derive(Debug)]
pub struct Analysis {
    pub modules: usize,
    pub edges: usize,
    pub circles: Vec<Circle>,
}

impl Analysis {
    /// What `cargo xtask modcycles` prints for one crate (paths relative to `root`).
    pub fn report(&self, name: &str, root: &Path) -> String {
        let mut out = format!(
            "{name}: {} modules, {} edges between siblings, {} circle{}\n",
            self.modules,
            self.edges,
            self.circles.len(),
            if self.circles.len() == 1 { "" } else { "s" }
        );
        for circle in &self.circles {
            let parent = std::iter::once("crate")
                .chain(circle.parent.iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join("::");
            out += &format!(
                "  circle among {parent}::{{{}}}\n",
                circle.members.join(", ")
            );
            for (from, to, witness) in &circle.edges {
                let file = witness.file.strip_prefix(root).unwrap_or(&witness.file);
                let more = match witness.count {
                    1 => String::new(),
                    n => format!(" (+{} more)", n - 1),
                };
                out += &format!(
                    "    {from} -> {to}: {}:{} `{}`{more}\n",
                    file.display(),
                    witness.line,
                    witness.path
                );
            }
        }
        out
    }
}

/// Read the crate whose root file is `root_file` and find its circles.
pub fn analyze(root_file: &Path, source: &dyn Source) -> Result<Analysis> {
    let mut crate_modules = BTreeMap::new();
    let dir = root_file.parent().unwrap_or(Path::new("")).to_path_buf();
    load_file(&mut crate_modules, Vec::new(), root_file, dir, source)?;
    let graph = Graph {
        modules: crate_modules,
    };
    Ok(graph.circles())
}

fn load_file(
    modules: &mut BTreeMap<ModPath, Module>,
    path: ModPath,
    file: &Path,
    child_dir: PathBuf,
    source: &dyn Source,
) -> Result<()> {
    let text = source
        .read(file)
        .with_context(|| format!("cannot read {}", file.display()))?;
    let parsed = syn::parse_file(&text).with_context(|| format!("parsing {}", file.display()))?;
    load_items(modules, path, &parsed.items, file, child_dir, false, source)
}

/// Record the module `path` with `items`; its child modules' files are in `child_dir`.
fn load_items(
    modules: &mut BTreeMap<ModPath, Module>,
    path: ModPath,
    items: &[syn::Item],
    file: &Path,
    child_dir: PathBuf,
    inline: bool,
    source: &dyn Source,
) -> Result<()> {
    let mut module = Module::default();
    let mut children = Vec::new();
    for item in items {
        if is_cfg_test(item_attrs(item)) {
            continue;
        }
        match item {
            syn::Item::Mod(m) => {
                let name = m.ident.to_string();
                module.children.insert(name.clone());
                children.push((name, m));
            }
            syn::Item::Use(u) => {
                let mut collector = References::new(file, &mut module.references);
                collector.use_tree(&u.tree, Vec::new(), u.leading_colon.is_some());
                flatten_use(
                    &u.tree,
                    Vec::new(),
                    u.leading_colon.is_some(),
                    &mut module.imports,
                    &mut module.globs,
                );
            }
            syn::Item::ExternCrate(e) => {
                let name = e
                    .rename
                    .as_ref()
                    .map(|(_, r)| r.to_string())
                    .unwrap_or_else(|| e.ident.to_string());
                let path = WrittenPath {
                    segments: vec![e.ident.to_string()],
                    leading_colon: true,
                };
                module.imports.push((name, path));
            }
            other => {
                if let Some(name) = item_name(other) {
                    module.defs.insert(name);
                }
                References::new(file, &mut module.references).visit_item(other);
            }
        }
    }
    modules.insert(path.clone(), module);

    for (name, m) in children {
        let mut child_path = path.clone();
        child_path.push(name.clone());
        let path_attr = m.attrs.iter().find_map(path_attribute);
        match &m.content {
            Some((_, items)) => {
                let dir = match &path_attr {
                    Some(p) => child_dir.join(p),
                    None => child_dir.join(&name),
                };
                load_items(modules, child_path, items, file, dir, true, source)?;
            }
            None => {
                let child_file = match &path_attr {
                    // `#[path]` is relative to the declaring file's folder, or to the
                    // folder an inline module stands for.
                    Some(p) if inline => child_dir.join(p),
                    Some(p) => file.parent().unwrap_or(Path::new("")).join(p),
                    None => {
                        let flat = child_dir.join(format!("{name}.rs"));
                        let nested = child_dir.join(&name).join("mod.rs");
                        if source.read(&flat).is_some() {
                            flat
                        } else {
                            nested
                        }
                    }
                };
                let grandchild_dir = if child_file.file_name() == Some("mod.rs".as_ref()) {
                    child_file.parent().unwrap_or(Path::new("")).to_path_buf()
                } else {
                    child_file.with_extension("")
                };
                load_file(modules, child_path, &child_file, grandchild_dir, source)?;
            }
        }
    }
    Ok(())
}

fn path_attribute(attr: &syn::Attribute) -> Option<String> {
    if !attr.path().is_ident("path") {
        return None;
    }
    match &attr.meta {
        syn::Meta::NameValue(syn::MetaNameValue {
            value:
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }),
            ..
        }) => Some(s.value()),
        _ => None,
    }
}

/// `#[cfg(test)]`, or a `cfg(all(test, …))`: code that only unit tests compile.
fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("cfg") && {
            let mut tokens = TokenStream::new();
            if let syn::Meta::List(list) = &attr.meta {
                tokens = list.tokens.clone();
            }
            let words: Vec<String> = tokens
                .into_iter()
                .map(|t| t.to_string().replace(' ', ""))
                .collect();
            words.first().is_some_and(|w| w == "test")
                || (words.first().is_some_and(|w| w == "all")
                    && words.get(1).is_some_and(|args| {
                        args.trim_matches(['(', ')'])
                            .split(',')
                            .any(|a| a == "test")
                    }))
        }
    })
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    use syn::Item::*;
    match item {
        Const(i) => &i.attrs,
        Enum(i) => &i.attrs,
        ExternCrate(i) => &i.attrs,
        Fn(i) => &i.attrs,
        ForeignMod(i) => &i.attrs,
        Impl(i) => &i.attrs,
        Macro(i) => &i.attrs,
        Mod(i) => &i.attrs,
        Static(i) => &i.attrs,
        Struct(i) => &i.attrs,
        Trait(i) => &i.attrs,
        TraitAlias(i) => &i.attrs,
        Type(i) => &i.attrs,
        Union(i) => &i.attrs,
        Use(i) => &i.attrs,
        _ => &[],
    }
}

fn item_name(item: &syn::Item) -> Option<String> {
    use syn::Item::*;
    let ident = match item {
        Const(i) => &i.ident,
        Enum(i) => &i.ident,
        Fn(i) => &i.sig.ident,
        Macro(i) => i.ident.as_ref()?,
        Static(i) => &i.ident,
        Struct(i) => &i.ident,
        Trait(i) => &i.ident,
        TraitAlias(i) => &i.ident,
        Type(i) => &i.ident,
        Union(i) => &i.ident,
        _ => return None,
    };
    Some(ident.to_string())
}

/// The names a `use` brings in (`imports`) and the modules it glob-imports (`globs`).
fn flatten_use(
    tree: &syn::UseTree,
    mut prefix: Vec<String>,
    leading_colon: bool,
    imports: &mut Vec<(String, WrittenPath)>,
    globs: &mut Vec<WrittenPath>,
) {
    let written = |segments: Vec<String>| WrittenPath {
        segments,
        leading_colon,
    };
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            flatten_use(&p.tree, prefix, leading_colon, imports, globs);
        }
        syn::UseTree::Name(n) if n.ident == "self" => {
            if let Some(last) = prefix.last().cloned() {
                imports.push((last, written(prefix)));
            }
        }
        syn::UseTree::Name(n) => {
            prefix.push(n.ident.to_string());
            imports.push((n.ident.to_string(), written(prefix)));
        }
        syn::UseTree::Rename(r) => {
            if r.ident != "self" {
                prefix.push(r.ident.to_string());
            }
            if r.rename != "_" {
                imports.push((r.rename.to_string(), written(prefix)));
            }
        }
        syn::UseTree::Glob(_) => globs.push(written(prefix)),
        syn::UseTree::Group(g) => {
            for tree in &g.items {
                flatten_use(tree, prefix.clone(), leading_colon, imports, globs);
            }
        }
    }
}

/// Collects the references of the items it visits.
struct References<'a> {
    file: &'a Path,
    out: &'a mut Vec<Reference>,
}

impl<'a> References<'a> {
    fn new(file: &'a Path, out: &'a mut Vec<Reference>) -> Self {
        References { file, out }
    }

    fn push(&mut self, segments: Vec<String>, leading_colon: bool, line: usize) {
        self.out.push(Reference {
            path: WrittenPath {
                segments,
                leading_colon,
            },
            file: self.file.to_path_buf(),
            line,
        });
    }

    /// Every leaf of a `use` tree is a reference (`self` in a group names the prefix).
    fn use_tree(&mut self, tree: &syn::UseTree, mut prefix: Vec<String>, leading_colon: bool) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(&p.tree, prefix, leading_colon);
            }
            syn::UseTree::Name(n) => {
                if n.ident != "self" {
                    prefix.push(n.ident.to_string());
                }
                self.push(prefix, leading_colon, n.ident.span().start().line);
            }
            syn::UseTree::Rename(r) => {
                if r.ident != "self" {
                    prefix.push(r.ident.to_string());
                }
                self.push(prefix, leading_colon, r.ident.span().start().line);
            }
            syn::UseTree::Glob(g) => {
                let line = g.star_token.spans[0].start().line;
                self.push(prefix, leading_colon, line);
            }
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.use_tree(tree, prefix.clone(), leading_colon);
                }
            }
        }
    }

    /// `crate::…`, `$crate::…`, `super::…` and `self::…` paths among a macro's tokens.
    fn tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let is_path_separator = |i: usize| {
            matches!(trees.get(i), Some(TokenTree::Punct(p)) if p.as_char() == ':' && p.spacing() == Spacing::Joint)
                && matches!(trees.get(i + 1), Some(TokenTree::Punct(p)) if p.as_char() == ':')
        };
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(group) => self.tokens(group.stream()),
                TokenTree::Ident(ident)
                    if is_path_start(&ident.to_string()) && is_path_separator(i + 1) =>
                {
                    let mut segments = vec![ident.to_string()];
                    let mut next = i + 1;
                    while is_path_separator(next) {
                        match trees.get(next + 2) {
                            Some(TokenTree::Ident(segment)) => {
                                segments.push(segment.to_string());
                                next += 3;
                            }
                            _ => break,
                        }
                    }
                    self.push(segments, false, ident.span().start().line);
                    i = next;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
    }
}

fn is_path_start(segment: &str) -> bool {
    matches!(segment, "crate" | "super" | "self")
}

impl<'ast> Visit<'ast> for References<'_> {
    fn visit_path(&mut self, path: &'ast syn::Path) {
        let first = path.segments.first().map(|s| s.ident.to_string());
        if path.segments.len() > 1 && first.as_deref().is_some_and(is_path_start) {
            let segments = path.segments.iter().map(|s| s.ident.to_string()).collect();
            let line = path.segments[0].ident.span().start().line;
            self.push(segments, path.leading_colon.is_some(), line);
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        if !is_cfg_test(&item.attrs) {
            self.use_tree(&item.tree, Vec::new(), item.leading_colon.is_some());
        }
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.tokens(mac.tokens.clone());
        syn::visit::visit_macro(self, mac);
    }

    fn visit_item(&mut self, item: &'ast syn::Item) {
        if !is_cfg_test(item_attrs(item)) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        let attrs = match item {
            syn::ImplItem::Const(i) => &i.attrs,
            syn::ImplItem::Fn(i) => &i.attrs,
            syn::ImplItem::Type(i) => &i.attrs,
            syn::ImplItem::Macro(i) => &i.attrs,
            _ => return syn::visit::visit_impl_item(self, item),
        };
        if !is_cfg_test(attrs) {
            syn::visit::visit_impl_item(self, item);
        }
    }

    /// `pub(in crate::x)` restricts visibility; it imports nothing.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    /// A module inside a function body: rare, and not part of the module tree walked.
    fn visit_item_mod(&mut self, _: &'ast syn::ItemMod) {}
}

struct Graph {
    modules: BTreeMap<ModPath, Module>,
}

impl Graph {
    /// The absolute form of `path` as written in module `from`, or `None` for another
    /// crate's path.
    fn absolute(&self, from: &ModPath, path: &WrittenPath) -> Option<Vec<String>> {
        if path.leading_colon {
            return None;
        }
        let (first, rest) = path.segments.split_first()?;
        match first.as_str() {
            "crate" | "$crate" => Some(rest.to_vec()),
            "self" => Some(from.iter().chain(rest).cloned().collect()),
            "super" => {
                let mut base = from.clone();
                let mut segments = path.segments.iter().peekable();
                while segments.next_if(|s| *s == "super").is_some() {
                    base.pop()?;
                }
                base.extend(segments.cloned());
                Some(base)
            }
            name => {
                let module = self.modules.get(from)?;
                let local = module.children.contains(name)
                    || module.defs.contains(name)
                    || module.imports.iter().any(|(n, _)| n == name);
                local.then(|| from.iter().chain(&path.segments).cloned().collect())
            }
        }
    }

    /// The module that defines what the absolute `path` names (the module itself when it
    /// names a module), following imports and re-exports; `None` for another crate.
    fn resolve(&self, path: &[String], hops: usize) -> Option<ModPath> {
        let mut current: ModPath = Vec::new();
        for (i, segment) in path.iter().enumerate() {
            let module = self.modules.get(&current)?;
            if module.children.contains(segment) {
                current.push(segment.clone());
                continue;
            }
            if module.defs.contains(segment) || hops >= MAX_HOPS {
                return Some(current);
            }
            if let Some((_, target)) = module.imports.iter().find(|(name, _)| name == segment) {
                let mut next = self.absolute(&current, target)?;
                next.extend(path[i + 1..].iter().cloned());
                return self.resolve(&next, hops + 1);
            }
            for glob in &module.globs {
                let Some(mut next) = self.absolute(&current, glob) else {
                    continue;
                };
                let Some(target) = self.resolve(&next, hops + 1) else {
                    continue;
                };
                let provides = self.modules.get(&target).is_some_and(|m| {
                    m.children.contains(segment)
                        || m.defs.contains(segment)
                        || m.imports.iter().any(|(name, _)| name == segment)
                });
                if provides {
                    next.extend(path[i..].iter().cloned());
                    return self.resolve(&next, hops + 1);
                }
            }
            // Not found: an item a macro generates here, or a prelude name.
            return Some(current);
        }
        Some(current)
    }

    fn circles(&self) -> Analysis {
        // Sibling edges, grouped by the parent whose children they join.
        let mut levels: BTreeMap<ModPath, BTreeMap<(String, String), Witness>> = BTreeMap::new();
        for (from, module) in &self.modules {
            for reference in &module.references {
                let Some(absolute) = self.absolute(from, &reference.path) else {
                    continue;
                };
                let Some(to) = self.resolve(&absolute, 0) else {
                    continue;
                };
                if to.starts_with(from) || from.starts_with(&to) {
                    continue; // the module tree itself: no edge
                }
                let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
                let key = (from[common].clone(), to[common].clone());
                let edges = levels.entry(from[..common].to_vec()).or_default();
                edges
                    .entry(key)
                    .and_modify(|w| w.count += 1)
                    .or_insert_with(|| Witness {
                        file: reference.file.clone(),
                        line: reference.line,
                        path: reference.path.segments.join("::"),
                        count: 1,
                    });
            }
        }
        let mut circles = Vec::new();
        for (parent, edges) in &levels {
            for members in strongly_connected(edges.keys()) {
                let inside: Vec<_> = edges
                    .iter()
                    .filter(|((a, b), _)| members.contains(a) && members.contains(b))
                    .map(|((a, b), w)| (a.clone(), b.clone(), w.clone()))
                    .collect();
                circles.push(Circle {
                    parent: parent.clone(),
                    members: members.into_iter().collect(),
                    edges: inside,
                });
            }
        }
        Analysis {
            modules: self.modules.len(),
            edges: levels.values().map(BTreeMap::len).sum(),
            circles,
        }
    }
}

/// The sets of two or more nodes that reach each other along `edges`.
fn strongly_connected<'a>(
    edges: impl Iterator<Item = &'a (String, String)>,
) -> Vec<BTreeSet<String>> {
    let mut next: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (a, b) in edges {
        next.entry(a).or_default().insert(b);
        next.entry(b).or_default();
    }
    let reach = |start: &str| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![start];
        while let Some(node) = stack.pop() {
            for &n in &next[node] {
                if seen.insert(n) {
                    stack.push(n);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&str, BTreeSet<&str>> = next.keys().map(|&n| (n, reach(n))).collect();
    let mut placed = BTreeSet::new();
    let mut sets = Vec::new();
    for (&node, reached) in &reaches {
        if placed.contains(node) || !reached.contains(node) {
            continue;
        }
        let set: BTreeSet<String> = reached
            .iter()
            .filter(|&&other| reaches[other].contains(node))
            .map(|s| s.to_string())
            .collect();
        placed.extend(set.iter().cloned());
        sets.push(set);
    }
    sets
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Files(HashMap<PathBuf, String>);

    impl Source for Files {
        fn read(&self, path: &Path) -> Option<String> {
            self.0.get(path).cloned()
        }
    }

    fn analyze_files(files: &[(&str, &str)]) -> Analysis {
        let files = Files(
            files
                .iter()
                .map(|(path, text)| (PathBuf::from(path), text.to_string()))
                .collect(),
        );
        analyze(Path::new("src/lib.rs"), &files).expect("the test crate parses")
    }

    fn members(analysis: &Analysis) -> Vec<Vec<String>> {
        analysis.circles.iter().map(|c| c.members.clone()).collect()
    }

    #[test]
    fn sibling_modules_that_import_each_other_are_a_circle() {
        let analysis = analyze_files(&[
            ("src/lib.rs", "mod error; mod qp; mod cq;"),
            (
                "src/error.rs",
                "use crate::qp::QpState; pub enum Error { A(QpState) }",
            ),
            ("src/qp.rs", "use crate::error::Error; pub struct QpState;"),
            ("src/cq.rs", "use crate::error::Error;"),
        ]);
        assert_eq!(members(&analysis), vec![vec!["error", "qp"]]);
        let circle = &analysis.circles[0];
        assert_eq!(circle.edges.len(), 2);
        let (from, to, witness) = &circle.edges[0];
        assert_eq!((from.as_str(), to.as_str()), ("error", "qp"));
        assert_eq!(witness.file, PathBuf::from("src/error.rs"));
        assert_eq!(witness.line, 1);
        assert_eq!(witness.path, "crate::qp::QpState");
        let report = analysis.report("demo", Path::new(""));
        assert!(
            report.contains("circle among crate::{error, qp}"),
            "{report}"
        );
        assert!(
            report.contains("error -> qp: src/error.rs:1 `crate::qp::QpState`"),
            "{report}"
        );
    }

    #[test]
    fn a_leaf_module_breaks_the_circle() {
        let analysis = analyze_files(&[
            ("src/lib.rs", "mod error; mod qp; mod status;"),
            ("src/status.rs", "pub struct QpState;"),
            ("src/error.rs", "use crate::status::QpState;"),
            (
                "src/qp.rs",
                "use crate::error::Error; use crate::status::QpState;",
            ),
        ]);
        assert!(analysis.circles.is_empty(), "{:?}", analysis.circles);
        assert_eq!(analysis.edges, 3);
    }

    #[test]
    fn parent_and_child_using_each_other_is_no_circle() {
        let analysis = analyze_files(&[
            ("src/lib.rs", "mod client; pub struct Config;"),
            (
                "src/client/mod.rs",
                "mod conn; use conn::Conn; pub fn lock() {}",
            ),
            (
                "src/client/conn.rs",
                "use super::lock; use crate::Config; pub struct Conn; fn f() { super::lock() }",
            ),
        ]);
        assert!(analysis.circles.is_empty(), "{:?}", analysis.circles);
        assert_eq!(analysis.edges, 0);
    }

    #[test]
    fn root_re_exports_are_followed_to_the_defining_module() {
        let analysis = analyze_files(&[
            (
                "src/lib.rs",
                "mod wr; mod qp; pub use qp::SendFlags; pub use wr::SendWr;",
            ),
            ("src/wr.rs", "pub struct SendWr(crate::SendFlags);"),
            (
                "src/qp.rs",
                "pub struct SendFlags; fn post(_: &[crate::SendWr]) {}",
            ),
        ]);
        assert_eq!(members(&analysis), vec![vec!["qp", "wr"]]);
    }

    #[test]
    fn a_circle_through_submodules_is_one_between_the_siblings() {
        let analysis = analyze_files(&[
            ("src/lib.rs", "mod agent; mod backends;"),
            ("src/agent.rs", "use crate::backends::heartbeat::pollfd_in;"),
            ("src/backends/mod.rs", "pub mod heartbeat; pub mod local;"),
            ("src/backends/heartbeat.rs", "pub fn pollfd_in() {}"),
            (
                "src/backends/local.rs",
                "fn new(a: &crate::agent::Agent) {}",
            ),
        ]);
        assert_eq!(members(&analysis), vec![vec!["agent", "backends"]]);
        assert!(analysis.circles[0].parent.is_empty());
    }

    #[test]
    fn circles_below_the_root_are_found_with_super_paths() {
        let analysis = analyze_files(&[
            ("src/lib.rs", "mod daemon;"),
            (
                "src/daemon/mod.rs",
                "mod gpu; mod io; mod ring; pub use ring::Ring;",
            ),
            ("src/daemon/gpu.rs", "use super::io::Request;"),
            (
                "src/daemon/io.rs",
                "pub struct Request; fn f(r: &super::Ring) {}",
            ),
            (
                "src/daemon/ring.rs",
                "pub struct Ring; fn g() { super::gpu::map(); }",
            ),
        ]);
        assert_eq!(members(&analysis), vec![vec!["gpu", "io", "ring"]]);
        assert_eq!(analysis.circles[0].parent, vec!["daemon".to_string()]);
    }

    #[test]
    fn unit_tests_and_doc_links_are_not_imports() {
        let analysis = analyze_files(&[
            ("src/lib.rs", "mod a; mod b;"),
            (
                "src/a.rs",
                "use crate::b::B;\n#[cfg(test)]\nmod tests { use crate::b::B; }",
            ),
            (
                "src/b.rs",
                "/// Like [`A`](crate::a::A).\npub struct B;\n#[cfg(test)]\nfn check() { crate::a::f(); }\n#[cfg(test)]\nmod tests { use crate::a::A; }",
            ),
        ]);
        assert!(analysis.circles.is_empty(), "{:?}", analysis.circles);
    }

    #[test]
    fn paths_inside_macros_and_inline_modules_count() {
        let analysis = analyze_files(&[
            (
                "src/lib.rs",
                "mod a; mod b { pub fn g() { tracing::warn!(\"{}\", crate::a::f()); } }",
            ),
            ("src/a.rs", "pub fn f() -> u8 { super::b::g(); 0 }"),
        ]);
        assert_eq!(members(&analysis), vec![vec!["a", "b"]]);
    }

    #[test]
    fn glob_re_exports_and_path_attributes_are_followed() {
        let analysis = analyze_files(&[
            (
                "src/lib.rs",
                "mod shared; #[path = \"other/place.rs\"] mod user;",
            ),
            ("src/shared/mod.rs", "mod inner; pub use inner::*;"),
            (
                "src/shared/inner.rs",
                "pub struct Thing; fn f() { crate::user::g(); }",
            ),
            (
                "src/other/place.rs",
                "use crate::shared::Thing; pub fn g() {}",
            ),
        ]);
        assert_eq!(members(&analysis), vec![vec!["shared", "user"]]);
        let edge = &analysis.circles[0].edges;
        assert!(edge.iter().any(|(from, to, w)| from == "user"
            && to == "shared"
            && w.file == Path::new("src/other/place.rs")));
    }

    #[test]
    fn other_crates_paths_are_no_edges() {
        let analysis = analyze_files(&[
            ("src/lib.rs", "pub use ibverbs_sys as ffi; mod a; mod b;"),
            ("src/a.rs", "use crate::ffi; use ::b::Thing; use std::fmt;"),
            ("src/b.rs", "use crate::ffi::ibv_qp; use serde::Serialize;"),
        ]);
        assert_eq!(analysis.edges, 0);
    }

    #[test]
    fn a_missing_module_file_is_an_error() {
        let files = Files(HashMap::from([(
            PathBuf::from("src/lib.rs"),
            "mod gone;".to_string(),
        )]));
        let err = analyze(Path::new("src/lib.rs"), &files).unwrap_err();
        assert!(format!("{err:#}").contains("src/gone/mod.rs"), "{err:#}");
    }

    #[test]
    fn strongly_connected_keeps_separate_circles_apart() {
        let edges: Vec<(String, String)> =
            [("a", "b"), ("b", "a"), ("c", "d"), ("d", "c"), ("b", "c")]
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
        let sets = strongly_connected(edges.iter());
        let sets: Vec<Vec<String>> = sets.into_iter().map(|s| s.into_iter().collect()).collect();
        assert_eq!(sets, vec![vec!["a", "b"], vec!["c", "d"]]);
    }
}
