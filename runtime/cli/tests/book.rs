//! The book (`docs/`) cannot rot: every page is in `SUMMARY.md`, every link between pages and
//! every `{{#include}}` resolves, every ` ```cell ` block checks clean, every ` ```console `
//! block's `cellc` commands run and print what the page shows, and every ` ```rust ` and
//! ` ```python ` block is an include of a file that a test runs. `docs/README.md` states the
//! rules; this file enforces them.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

/// The repository's root folder.
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The book's source folder.
fn book_src() -> PathBuf {
    repo_root().join("docs/src")
}

/// `path` with `.` and `..` folded away, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Every markdown file under the book's source folder, as paths relative to it.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read docs/src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                walk(&path, root, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path.strip_prefix(root).expect("under docs/src").to_path_buf());
            }
        }
    }
    let mut out = Vec::new();
    walk(&book_src(), &book_src(), &mut out);
    out.sort();
    out
}

/// The pages `SUMMARY.md` lists, in order.
fn summary_pages() -> Vec<PathBuf> {
    let summary = std::fs::read_to_string(book_src().join("SUMMARY.md")).expect("SUMMARY.md");
    links(&summary).into_iter().map(|l| PathBuf::from(l.target)).collect()
}

/// One `[text](target)` link of a page, outside code.
#[derive(Debug)]
struct Link {
    target: String,
    line: usize,
}

/// The links of a markdown text, skipping fenced blocks and code spans.
fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    let mut in_fence = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let mut in_code = false;
        let bytes = line.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'`' => in_code = !in_code,
                b']' if !in_code && bytes.get(i + 1) == Some(&b'(') => {
                    if let Some(end) = line[i + 2..].find(')') {
                        let target = line[i + 2..i + 2 + end].trim();
                        // `[text](url "title")`: the url only.
                        let target = target.split_whitespace().next().unwrap_or("");
                        out.push(Link { target: target.to_string(), line: n + 1 });
                        i += 2 + end;
                    }
                }
                _ => {}
            }
            i += 1;
        }
    }
    out
}

/// The ids mdBook gives a page's headings: the text without markup, lower case, spaces as
/// `-`, other punctuation dropped, and `-1`, `-2`, ... after repeats.
fn heading_ids(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut ids = BTreeSet::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        // Link text stays, link targets go: `[a](b)` reads `a`.
        let mut plain = String::new();
        let mut skipping_target = false;
        let mut prev = ' ';
        for ch in title.chars() {
            if skipping_target {
                if ch == ')' {
                    skipping_target = false;
                }
            } else if ch == '(' && prev == ']' {
                skipping_target = true;
            } else {
                plain.push(ch);
            }
            prev = ch;
        }
        let id: String = plain
            .chars()
            .filter_map(|c| {
                if c.is_alphanumeric() || c == '_' || c == '-' {
                    Some(c.to_lowercase().next().unwrap_or(c))
                } else if c.is_whitespace() {
                    Some('-')
                } else {
                    None
                }
            })
            .collect();
        let count = seen.entry(id.clone()).or_insert(0);
        ids.insert(if *count == 0 { id.clone() } else { format!("{id}-{count}") });
        *count += 1;
    }
    ids
}

/// One `{{#include path[:anchor]}}` of a text: where it stands and what it names.
struct Directive<'a> {
    range: std::ops::Range<usize>,
    spec: &'a str,
}

impl Directive<'_> {
    /// The file it names, relative to its page's folder.
    fn path(&self) -> &str {
        self.spec.split(':').next().unwrap_or("")
    }
}

/// The include directives of a text, in order. `\{{#include ...}}` shows the directive itself
/// (mdBook drops the backslash), so it is none.
fn include_directives(text: &str) -> Result<Vec<Directive<'_>>, String> {
    const OPEN: &str = "{{#include ";
    let mut out = Vec::new();
    for (start, _) in text.match_indices(OPEN) {
        if text[..start].ends_with('\\') {
            continue;
        }
        let end = text[start..].find("}}").ok_or("an include directive is not closed with `}}`")? + start;
        out.push(Directive { range: start..end + 2, spec: text[start + OPEN.len()..end].trim() });
    }
    Ok(out)
}

/// A page's text with every include replaced by what it names, as mdBook does, or the first
/// include that names no file or anchor.
fn expand_includes(page: &Path, text: &str) -> Result<String, String> {
    let dir = page.parent().unwrap_or(Path::new(""));
    let failed = |e: String| format!("{}: {e}", page.display());
    let shown = |between: &str| between.replace("\\{{#include ", "{{#include ");
    let mut out = String::new();
    let mut done = 0;
    for directive in include_directives(text).map_err(failed)? {
        out.push_str(&shown(&text[done..directive.range.start]));
        out.push_str(&included(dir, directive.spec).map_err(failed)?);
        done = directive.range.end;
    }
    out.push_str(&shown(&text[done..]));
    Ok(out)
}

/// What one include names: a whole file, or the lines between `ANCHOR: name` and
/// `ANCHOR_END: name` (marker lines of other anchors dropped).
fn included(dir: &Path, spec: &str) -> Result<String, String> {
    let (path, anchor) = match spec.split_once(':') {
        Some((p, a)) => (p, Some(a)),
        None => (spec, None),
    };
    let file = book_src().join(dir).join(path);
    let text = std::fs::read_to_string(&file).map_err(|e| format!("include `{spec}`: {e}"))?;
    let keep = |l: &str| !l.contains("ANCHOR: ") && !l.contains("ANCHOR_END: ");
    let Some(anchor) = anchor else {
        return Ok(text.lines().filter(|l| keep(l)).map(|l| format!("{l}\n")).collect());
    };
    let begin = format!("ANCHOR: {anchor}");
    let end = format!("ANCHOR_END: {anchor}");
    let lines: Vec<&str> = text.lines().collect();
    let first = lines
        .iter()
        .position(|l| l.trim_end().ends_with(&begin))
        .ok_or_else(|| format!("include `{spec}`: no `{begin}` in {path}"))?;
    let last = lines[first..]
        .iter()
        .position(|l| l.trim_end().ends_with(&end))
        .ok_or_else(|| format!("include `{spec}`: no `{end}` in {path}"))?;
    let body = &lines[first + 1..first + last];
    // mdBook shows an anchored part with its common indentation removed.
    let indent = body
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    Ok(body.iter().filter(|l| keep(l)).map(|l| format!("{}\n", l.get(indent..).unwrap_or(""))).collect())
}

/// One fenced block of a page: its info string, its lines as written (includes unexpanded)
/// and as the reader sees them, and the line it starts on.
#[derive(Debug)]
struct Block {
    info: String,
    raw: String,
    body: String,
    line: usize,
}

/// The fenced blocks of a page.
fn blocks(page: &Path, text: &str) -> Result<Vec<Block>, String> {
    let mut out = Vec::new();
    let mut open: Option<(String, usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        match (&mut open, trimmed.strip_prefix("```")) {
            (None, Some(info)) => open = Some((info.trim().to_string(), n + 1, String::new())),
            (Some(_), Some(rest)) if rest.trim().is_empty() => {
                let (info, line, raw) = open.take().expect("open block");
                let body = expand_includes(page, &raw)?;
                out.push(Block { info, raw, body, line });
            }
            (Some((_, _, raw)), _) => {
                raw.push_str(line);
                raw.push('\n');
            }
            (None, None) => {}
        }
    }
    match open {
        Some((_, line, _)) => Err(format!("{}:{line}: unclosed code block", page.display())),
        None => Ok(out),
    }
}

/// The fence kinds a page may use (`docs/README.md`).
const KINDS: &[&str] = &["cell", "console", "console,fails", "rust", "python", "sh", "text", "toml"];

/// The problems of one page: its links, includes and code blocks.
fn check_page(
    page: &Path,
    pages: &BTreeSet<PathBuf>,
    ids: &HashMap<PathBuf, BTreeSet<String>>,
) -> Vec<String> {
    let text = match std::fs::read_to_string(book_src().join(page)) {
        Ok(text) => text,
        Err(e) => return vec![format!("{}: {e}", page.display())],
    };
    let mut problems = Vec::new();
    let at = |line: usize| format!("{}:{line}", page.display());
    for link in links(&text) {
        let target = link.target.as_str();
        if target.starts_with("http://") || target.starts_with("https://") || target.starts_with("mailto:") {
            continue;
        }
        let (file, fragment) = target.split_once('#').unwrap_or((target, ""));
        let resolved = if file.is_empty() {
            page.to_path_buf()
        } else {
            normalize(&page.parent().unwrap_or(Path::new("")).join(file))
        };
        if resolved.starts_with("..") || !pages.contains(&resolved) {
            problems.push(format!(
                "{}: link `{target}` is not a page of the book (name repository files as code)",
                at(link.line)
            ));
        } else if !fragment.is_empty() && !ids.get(&resolved).is_some_and(|ids| ids.contains(fragment)) {
            problems.push(format!(
                "{}: link `{target}`: no heading `#{fragment}` in {}",
                at(link.line),
                resolved.display()
            ));
        }
    }
    let blocks = match blocks(page, &text) {
        Ok(b) => b,
        Err(e) => return vec![e],
    };
    for block in blocks {
        let where_ = at(block.line);
        if !KINDS.contains(&block.info.as_str()) {
            problems.push(format!("{where_}: a ```{} block: use one of {KINDS:?}", block.info));
            continue;
        }
        // Each line is one include of a file under `prefix` (a path from the repository's root).
        let only_includes_of = |prefix: &str| {
            block.raw.lines().map(str::trim).filter(|l| !l.is_empty()).all(|l| {
                match include_directives(l).as_deref() {
                    Ok([directive]) if directive.range == (0..l.len()) => {
                        let dir = Path::new("docs/src").join(page.parent().unwrap_or(Path::new("")));
                        normalize(&dir.join(directive.path())).starts_with(prefix)
                    }
                    _ => false,
                }
            })
        };
        match block.info.as_str() {
            "rust" if !only_includes_of("examples") => problems.push(format!(
                "{where_}: a ```rust block must only include a file under examples/ (a test runs it)"
            )),
            "python" if !only_includes_of("docs/samples") => problems.push(format!(
                "{where_}: a ```python block must only include a script of docs/samples/ (test_book_samples.py runs it)"
            )),
            _ => problems.extend(run_block(&block.info, &block.body).into_iter().map(|e| format!("{where_}: {e}"))),
        }
    }
    problems
}

/// The problems of running a block whose kind runs: `cellc check` of a ` ```cell ` block, the
/// commands of a ` ```console ` one; none for the kinds that do not run.
fn run_block(info: &str, body: &str) -> Vec<String> {
    match info {
        "cell" => check_cell(body).into_iter().collect(),
        "console" | "console,fails" => run_console(body, info == "console,fails"),
        _ => Vec::new(),
    }
}

/// A ` ```cell ` block's problem, if `cellc check` finds an error in it.
fn check_cell(source: &str) -> Option<String> {
    // A file of its own: the tests checking the book and the README run at
    // once, in one process, and a shared file was rewritten under a check.
    static BLOCKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = BLOCKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = common::temp_file(&format!("book_block_{n}.cell"), source.as_bytes());
    let out = common::cellc(&["check", common::arg(&file)]);
    (!out.status.success()).then(|| {
        format!(
            "this ```cell block does not check:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A command line split into words: whitespace separates, double quotes group.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    let mut any = false;
    for ch in line.chars() {
        match ch {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            c => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(word);
    }
    out
}

/// Runs a ` ```console ` block's commands from the repository root; each must succeed (or
/// fail, for `console,fails`) and print the lines shown below it.
fn run_console(body: &str, fails: bool) -> Vec<String> {
    let mut problems = Vec::new();
    let mut commands: Vec<(String, Vec<String>)> = Vec::new();
    for line in body.lines() {
        match line.strip_prefix("$ ") {
            Some(command) => commands.push((command.to_string(), Vec::new())),
            None => match commands.last_mut() {
                Some((_, shown)) => shown.push(line.trim_end().to_string()),
                None => problems.push(format!("console output before any `$ ` command: `{line}`")),
            },
        }
    }
    std::fs::create_dir_all(repo_root().join("target/book-samples")).expect("target/book-samples");
    for (command, shown) in commands {
        let args = words(&command);
        if args.first().map(String::as_str) != Some("cellc") {
            problems.push(format!("`{command}`: a ```console block runs only `cellc` commands (use ```sh)"));
            continue;
        }
        let args: Vec<&str> = args[1..].iter().map(String::as_str).collect();
        let out = common::cellc_in(&repo_root(), &args);
        let printed =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if out.status.success() == fails {
            problems.push(format!(
                "`{command}` exited with {} (expected it to {}):\n{printed}",
                out.status,
                if fails { "fail" } else { "succeed" }
            ));
        }
        if let Err(e) = matches_shown(&shown, &printed) {
            problems.push(format!("`{command}`: {e}\nit printed:\n{printed}"));
        }
    }
    problems
}

/// Whether `printed` shows `shown`: groups of lines between `...` lines match consecutive
/// lines, in order; without a leading (trailing) `...` the first (last) group is the output's
/// start (end). Trailing blank lines of either are ignored.
fn matches_shown(shown: &[String], printed: &str) -> Result<(), String> {
    let trim_blank_end = |mut v: Vec<String>| {
        while v.last().is_some_and(|l: &String| l.is_empty()) {
            v.pop();
        }
        v
    };
    let shown = trim_blank_end(shown.to_vec());
    if shown.is_empty() {
        return Ok(());
    }
    let printed = trim_blank_end(printed.lines().map(|l| l.trim_end().to_string()).collect());
    let groups: Vec<&[String]> = shown.split(|l| l == "...").collect();
    let mut pos = 0;
    let last = groups.len() - 1;
    for (g, group) in groups.iter().enumerate() {
        if group.is_empty() {
            continue;
        }
        let anchored_start = g == 0;
        let found = (pos..=printed.len().saturating_sub(group.len()))
            .find(|&i| printed.get(i..i + group.len()) == Some(group))
            .filter(|&i| !anchored_start || i == 0);
        let Some(i) = found else {
            return Err(format!("these lines were not printed, in this order:\n{}", group.join("\n")));
        };
        pos = i + group.len();
        if g == last && pos != printed.len() {
            return Err(format!(
                "it printed more after `{}` (end the block with `...`)",
                group.last().map_or("", |s| s)
            ));
        }
    }
    Ok(())
}

#[test]
fn every_page_is_in_the_summary_and_every_summary_entry_exists() {
    let listed: BTreeSet<PathBuf> = summary_pages().into_iter().collect();
    for page in &listed {
        assert!(book_src().join(page).is_file(), "SUMMARY.md lists {}, which does not exist", page.display());
    }
    // Pages only included by others (the generated tables) need not be listed.
    let included: BTreeSet<PathBuf> = markdown_files()
        .iter()
        .flat_map(|page| {
            let text = std::fs::read_to_string(book_src().join(page)).expect("page");
            let dir = page.parent().unwrap_or(Path::new("")).to_path_buf();
            let directives = include_directives(&text).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
            directives.iter().map(|d| normalize(&dir.join(d.path()))).collect::<Vec<_>>()
        })
        .collect();
    for page in markdown_files() {
        if page != Path::new("SUMMARY.md") {
            assert!(
                listed.contains(&page) || included.contains(&page),
                "docs/src/{} is neither in SUMMARY.md nor included by a page",
                page.display()
            );
        }
    }
}

#[test]
fn links_includes_and_code_samples_of_every_page_hold() {
    let pages: BTreeSet<PathBuf> = markdown_files().into_iter().collect();
    let ids: HashMap<PathBuf, BTreeSet<String>> = pages
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(book_src().join(p)).expect("page");
            let expanded = expand_includes(p, &text).unwrap_or(text);
            (p.clone(), heading_ids(&expanded))
        })
        .collect();
    let problems: Vec<String> = summary_pages().iter().flat_map(|p| check_page(p, &pages, &ids)).collect();
    assert!(problems.is_empty(), "{} problems in the book:\n\n{}", problems.len(), problems.join("\n\n"));
}

/// The lines of a sample that matter when comparing copies: no blank lines, no whole-line
/// comments.
fn sample_lines(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim_end)
        .filter(|l| {
            !l.trim().is_empty() && !l.trim_start().starts_with("//") && !l.trim_start().starts_with("# ")
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn the_readmes_samples_are_copies_of_tested_ones_and_run() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    // The README is read on its own: its blocks are written out, not included.
    let page = Path::new("../../README.md");
    let mut problems = Vec::new();
    let lines: Vec<&str> = readme.lines().collect();
    for block in blocks(page, &readme).expect("README.md's blocks") {
        let at = format!("README.md:{}", block.line);
        let marker = lines[..block.line - 1]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .and_then(|l| l.trim().strip_prefix("<!-- sample: "))
            .and_then(|l| l.strip_suffix(" -->"));
        match marker {
            Some(spec) => match included(Path::new("../.."), spec) {
                Ok(tested) if sample_lines(&tested) == sample_lines(&block.raw) => {}
                Ok(_) => problems.push(format!("{at}: this block differs from {spec}: copy it again")),
                Err(e) => problems.push(format!("{at}: {e}")),
            },
            None if ["rust", "python"].contains(&block.info.as_str()) => problems.push(format!(
                "{at}: a ```{} block needs a `<!-- sample: path:anchor -->` line before it, naming the tested file it copies",
                block.info
            )),
            None => {}
        }
        if KINDS.contains(&block.info.as_str()) {
            problems.extend(run_block(&block.info, &block.raw).into_iter().map(|e| format!("{at}: {e}")));
        } else {
            problems.push(format!("{at}: a ```{} block: use one of {KINDS:?}", block.info));
        }
    }
    assert!(problems.is_empty(), "{} problems in README.md:\n\n{}", problems.len(), problems.join("\n\n"));
}

#[test]
fn console_output_matching_reads_groups_in_order() {
    let printed = "a\nb\nc\nd\n";
    let shown = |s: &str| s.lines().map(str::to_string).collect::<Vec<_>>();
    assert!(matches_shown(&shown("a\nb\nc\nd"), printed).is_ok());
    assert!(matches_shown(&shown("a\n...\nd"), printed).is_ok());
    assert!(matches_shown(&shown("...\nc\n..."), printed).is_ok());
    assert!(matches_shown(&shown("a\nc\n..."), printed).is_err(), "a group is consecutive lines");
    assert!(
        matches_shown(&shown("b\n..."), printed).is_err(),
        "without `...` first, the output starts there"
    );
    assert!(matches_shown(&shown("a\nb"), printed).is_err(), "without `...` last, the output ends there");
    assert!(matches_shown(&shown("...\nd\n...\na"), printed).is_err(), "groups in order");
}

#[test]
fn heading_ids_follow_mdbook() {
    let ids =
        heading_ids("# The `cellc` CLI\n## Speed: B=1, H=64\n## Speed: B=1, H=64\n### [Link](x.md) text\n");
    let want: BTreeSet<String> = ["the-cellc-cli", "speed-b1-h64", "speed-b1-h64-1", "link-text"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(ids, want);
}
