//! A crate's modules and which of them name which: the module tree read
//! from `mod` declarations, and every path in `use` items, in code and in
//! macro arguments resolved to the module that defines what it names
//! (through re-exports and imports), so that reaching an item through a
//! parent's `pub use` counts as reaching the module that defines it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{Spacing, TokenStream, TokenTree};
use quote::ToTokens;

type ModId = usize;

/// A path as written, with the module it was written in.
#[derive(Clone, Debug)]
struct Written {
    module: ModId,
    segments: Vec<String>,
}

#[derive(Debug, Default)]
struct Module {
    parent: Option<ModId>,
    /// The file the module is in (an inline module is in its parent's).
    file: String,
    children: BTreeMap<String, ModId>,
    /// Names of the items defined here (types, functions, constants...).
    items: BTreeSet<String>,
    /// Names brought in by `use`, each with the path it stands for.
    imports: BTreeMap<String, Written>,
    /// `use path::*`.
    globs: Vec<Written>,
    /// Every path of two segments or more written here, `use` items too.
    references: Vec<Written>,
}

pub struct ModuleTree {
    modules: Vec<Module>,
}

impl ModuleTree {
    /// Reads the module tree from a crate root (`lib.rs`, `main.rs`...).
    pub fn read(root: &Path) -> ModuleTree {
        let mut tree = ModuleTree { modules: Vec::new() };
        let base = root.parent().expect("a crate root is in a directory").to_owned();
        let name = root.file_name().unwrap().to_string_lossy().into_owned();
        tree.read_file(&base, root, name, None, true);
        tree
    }

    /// The files and, for each, the other files it names.
    pub fn file_graph(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for module in &self.modules {
            graph.entry(module.file.clone()).or_default();
            for reference in &module.references {
                if let Some(target) = self.resolve(reference.module, &reference.segments, 0) {
                    let target = &self.modules[target].file;
                    if *target != module.file {
                        graph.get_mut(&module.file).unwrap().insert(target.clone());
                    }
                }
            }
        }
        graph
    }

    /// Reads the module in `file`; `mod_rs` says whether its children's
    /// files are beside it (`lib.rs`, `mod.rs`) or in a folder of its name.
    fn read_file(
        &mut self,
        base: &Path,
        file: &Path,
        name: String,
        parent: Option<ModId>,
        mod_rs: bool,
    ) -> ModId {
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let parsed = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let id = self.add(parent, &name, display(base, file));
        let children_dir = if mod_rs {
            file.parent().unwrap().to_owned()
        } else {
            file.with_extension("")
        };
        self.read_items(base, &parsed.items, id, &children_dir, file.parent().unwrap());
        id
    }

    fn add(&mut self, parent: Option<ModId>, name: &str, file: String) -> ModId {
        let id = self.modules.len();
        self.modules.push(Module {
            parent,
            file,
            ..Module::default()
        });
        if let Some(parent) = parent {
            self.modules[parent].children.insert(name.to_owned(), id);
        }
        id
    }

    fn read_items(
        &mut self,
        base: &Path,
        items: &[syn::Item],
        id: ModId,
        children_dir: &Path,
        file_dir: &Path,
    ) {
        for item in items {
            match item {
                syn::Item::Mod(module) => {
                    let name = module.ident.to_string();
                    match &module.content {
                        Some((_, inline)) => {
                            let file = self.modules[id].file.clone();
                            let child = self.add(Some(id), &name, file);
                            self.read_items(base, inline, child, &children_dir.join(&name), file_dir);
                        }
                        None => {
                            let (path, mod_rs) = match path_attribute(&module.attrs) {
                                Some(path) => {
                                    let path = file_dir.join(path);
                                    let mod_rs = path.file_name().is_some_and(|n| n == "mod.rs");
                                    (path, mod_rs)
                                }
                                None => {
                                    let flat = children_dir.join(format!("{name}.rs"));
                                    if flat.exists() {
                                        (flat, false)
                                    } else {
                                        (children_dir.join(&name).join("mod.rs"), true)
                                    }
                                }
                            };
                            self.read_file(base, &path, name, Some(id), mod_rs);
                        }
                    }
                }
                syn::Item::Use(used) => {
                    let mut leaves = Vec::new();
                    use_leaves(&used.tree, &mut Vec::new(), &mut leaves);
                    for leaf in leaves {
                        let written = Written {
                            module: id,
                            segments: leaf.path,
                        };
                        self.modules[id].references.push(written.clone());
                        match leaf.name {
                            Some(name) => {
                                self.modules[id].imports.insert(name, written);
                            }
                            None => self.modules[id].globs.push(written),
                        }
                    }
                }
                other => {
                    if let Some(name) = item_name(other) {
                        self.modules[id].items.insert(name);
                    }
                    let mut paths = Vec::new();
                    token_paths(other.to_token_stream(), &mut paths);
                    for segments in paths {
                        self.modules[id].references.push(Written { module: id, segments });
                    }
                }
            }
        }
    }

    /// The module that defines what `segments`, written in `module`, names;
    /// `None` for what is outside the crate (another crate, a local name).
    fn resolve(&self, module: ModId, segments: &[String], depth: usize) -> Option<ModId> {
        if depth > 16 || segments.is_empty() {
            return None;
        }
        let here = &self.modules[module];
        let (mut current, rest) = match segments[0].as_str() {
            "crate" => (0, &segments[1..]),
            "self" => (module, &segments[1..]),
            "super" => {
                let mut current = module;
                let mut rest = segments;
                while rest.first().is_some_and(|s| s == "super") {
                    current = self.modules[current].parent?;
                    rest = &rest[1..];
                }
                (current, rest)
            }
            first => {
                if let Some(child) = here.children.get(first) {
                    (*child, &segments[1..])
                } else if let Some(import) = here.imports.get(first) {
                    let joined = joined(&import.segments, &segments[1..]);
                    return self.resolve(import.module, &joined, depth + 1);
                } else {
                    return None;
                }
            }
        };
        for (i, segment) in rest.iter().enumerate() {
            let module = &self.modules[current];
            if let Some(child) = module.children.get(segment) {
                current = *child;
            } else if module.items.contains(segment) {
                return Some(current);
            } else if let Some(import) = module.imports.get(segment) {
                let joined = joined(&import.segments, &rest[i + 1..]);
                return self.resolve(import.module, &joined, depth + 1).or(Some(current));
            } else {
                for glob in &module.globs {
                    let joined = joined(&glob.segments, &rest[i..]);
                    if let Some(found) = self.resolve(glob.module, &joined, depth + 1) {
                        return Some(found);
                    }
                }
                return Some(current);
            }
        }
        Some(current)
    }
}

fn joined(first: &[String], then: &[String]) -> Vec<String> {
    first.iter().chain(then).cloned().collect()
}

fn display(base: &Path, file: &Path) -> String {
    file.strip_prefix(base)
        .unwrap_or(file)
        .to_string_lossy()
        .into_owned()
}

fn path_attribute(attrs: &[syn::Attribute]) -> Option<PathBuf> {
    attrs.iter().find_map(|attr| match &attr.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(PathBuf::from(s.value())),
            _ => None,
        },
        _ => None,
    })
}

fn item_name(item: &syn::Item) -> Option<String> {
    Some(
        match item {
            syn::Item::Const(i) => &i.ident,
            syn::Item::Enum(i) => &i.ident,
            syn::Item::ExternCrate(i) => i.rename.as_ref().map(|(_, r)| r).unwrap_or(&i.ident),
            syn::Item::Fn(i) => &i.sig.ident,
            syn::Item::Macro(i) => i.ident.as_ref()?,
            syn::Item::Static(i) => &i.ident,
            syn::Item::Struct(i) => &i.ident,
            syn::Item::Trait(i) => &i.ident,
            syn::Item::TraitAlias(i) => &i.ident,
            syn::Item::Type(i) => &i.ident,
            syn::Item::Union(i) => &i.ident,
            _ => return None,
        }
        .to_string(),
    )
}

struct Leaf {
    /// The name it brings into scope; `None` for a glob.
    name: Option<String>,
    path: Vec<String>,
}

fn use_leaves(tree: &syn::UseTree, prefix: &mut Vec<String>, leaves: &mut Vec<Leaf>) {
    match tree {
        syn::UseTree::Path(path) => {
            prefix.push(path.ident.to_string());
            use_leaves(&path.tree, prefix, leaves);
            prefix.pop();
        }
        syn::UseTree::Name(name) => {
            let ident = name.ident.to_string();
            if ident == "self" {
                if let Some(last) = prefix.last() {
                    leaves.push(Leaf {
                        name: Some(last.clone()),
                        path: prefix.clone(),
                    });
                }
            } else {
                let mut path = prefix.clone();
                path.push(ident.clone());
                leaves.push(Leaf {
                    name: Some(ident),
                    path,
                });
            }
        }
        syn::UseTree::Rename(rename) => {
            let mut path = prefix.clone();
            path.push(rename.ident.to_string());
            if rename.ident == "self" {
                path.pop();
            }
            leaves.push(Leaf {
                name: Some(rename.rename.to_string()),
                path,
            });
        }
        syn::UseTree::Glob(_) => leaves.push(Leaf {
            name: None,
            path: prefix.clone(),
        }),
        syn::UseTree::Group(group) => {
            for tree in &group.items {
                use_leaves(tree, prefix, leaves);
            }
        }
    }
}

/// Every `a::b(::c)*` in a token stream, macro arguments included; a path
/// after a leading `::` is another crate's and left out.
fn token_paths(tokens: TokenStream, paths: &mut Vec<Vec<String>>) {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    let is_colons = |i: usize| {
        matches!((tokens.get(i), tokens.get(i + 1)),
            (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
                if a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':')
    };
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            TokenTree::Group(group) => {
                token_paths(group.stream(), paths);
                i += 1;
            }
            TokenTree::Ident(ident) => {
                let absolute = i >= 2 && is_colons(i - 2);
                let mut segments = vec![ident.to_string()];
                let mut j = i + 1;
                while is_colons(j) {
                    match tokens.get(j + 2) {
                        Some(TokenTree::Ident(next)) => {
                            segments.push(next.to_string());
                            j += 3;
                        }
                        _ => break,
                    }
                }
                if segments.len() > 1 && !absolute {
                    paths.push(segments);
                }
                i = j.max(i + 1);
            }
            _ => i += 1,
        }
    }
}

/// The circles of a directed graph: for each group of nodes that all reach
/// each other, one circle through its first node, first node repeated at
/// the end.
pub fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut in_circle = BTreeSet::new();
    for start in graph.keys() {
        if in_circle.contains(start) {
            continue;
        }
        // The shortest way back to `start`, breadth first.
        let mut came_from: BTreeMap<&String, &String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        let mut closed = None;
        while let Some(node) = queue.pop_front() {
            for next in graph.get(node).into_iter().flatten() {
                if next == start {
                    closed = Some(node);
                    break;
                }
                if !came_from.contains_key(next) && graph.contains_key(next) {
                    came_from.insert(next, node);
                    queue.push_back(next);
                }
            }
            if closed.is_some() {
                break;
            }
        }
        if let Some(closed) = closed {
            // Back from the node that closes the circle to `start`.
            let mut circle = vec![closed.clone()];
            let mut node = closed;
            while node != start {
                node = came_from[node];
                circle.push(node.clone());
            }
            circle.reverse();
            circle.push(start.clone());
            // The circle's nodes are reported once, as this circle.
            in_circle.extend(circle.iter().cloned());
            found.push(circle);
        }
    }
    found
}
