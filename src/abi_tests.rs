//! One definition of the C ABI, checked: `include/cachealloc.h` is what
//! cbindgen makes of `src/capi.rs`, `src/capi_torch.rs` and
//! `src/capi_torch/*.rs` today, the
//! Python package's generated table (`_abi.py`: the header's constants and
//! the name of every statistics slot) is what the header and
//! [`stat_names`](crate::capi_torch::stat_names) give, and every entry of
//! the Python ctypes table (`_SIGNATURES` in `cachealloc_torch/__init__.py`)
//! agrees with the header's declaration of that function.
//!
//! `CACHEALLOC_UPDATE_ABI=1 cargo test --lib abi_` rewrites the two
//! generated files. The checks read source text only, so they run without
//! the feature `cuda` (the exported functions are behind it).

use crate::capi_torch::stat_names;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

const HEADER: &str = "include/cachealloc.h";
const PY_TABLE: &str = "python/cachealloc_torch/_abi.py";
const PY_INIT: &str = "python/cachealloc_torch/__init__.py";

/// The source files of the two ABI modules: `src/capi.rs`,
/// `src/capi_torch.rs` and the files of its submodules (`src/capi_torch/*.rs`,
/// one per feature), in name order.
fn abi_sources() -> Vec<PathBuf> {
    let mut sub: Vec<PathBuf> = std::fs::read_dir(root().join("src/capi_torch"))
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "rs"))
                .collect()
        })
        .unwrap_or_default();
    sub.sort();
    let mut out = vec![root().join("src/capi.rs"), root().join("src/capi_torch.rs")];
    out.extend(sub);
    out
}

/// The header cbindgen writes from the ABI modules with `cbindgen.toml`.
fn generate_header() -> String {
    let config = cbindgen::Config::from_file(root().join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = abi_sources()
        .into_iter()
        .fold(cbindgen::Builder::new().with_config(config), |b, src| {
            b.with_src(src)
        })
        .generate()
        .expect("cbindgen reads the ABI modules");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("the header is UTF-8")
}

/// The `#define NAME value` lines of `header` whose value is a number.
fn header_constants(header: &str) -> Vec<(String, u64)> {
    header
        .lines()
        .filter_map(|l| l.strip_prefix("#define "))
        .filter_map(|l| {
            let (name, value) = l.split_once(' ')?;
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// `_abi.py`: the header's constants (without the `CACHEALLOC_` prefix) and
/// the `memory_stats()` key of every slot of the statistics vector.
fn generate_python_table(header: &str) -> String {
    let mut s = String::from(
        "\"\"\"The C ABI's constants for Python: generated from include/cachealloc.h\n\
         (itself generated from src/capi.rs and src/capi_torch.rs) by src/abi_tests.rs;\n\
         do not edit. `CACHEALLOC_UPDATE_ABI=1 cargo test --lib abi_` rewrites it.\n\
         \n\
         STATS_* and STAT_*: Note [The statistics vector]; SEGMENT_* and BLOCK_*:\n\
         Note [The snapshot words] (src/capi_torch.rs). STAT_NAMES[i] is the\n\
         torch.cuda.memory_stats() key of slot i of the statistics vector.\n\
         \"\"\"\n\n",
    );
    for (name, value) in header_constants(header) {
        let short = name.strip_prefix("CACHEALLOC_").unwrap_or(&name);
        s += &format!("{short} = {value}\n");
    }
    s += "\nSTAT_NAMES = (\n";
    for n in stat_names() {
        s += &format!("    \"{n}\",\n");
    }
    s += ")\n";
    s
}

/// Compares `path` with `want`, or writes `want` there with `CACHEALLOC_UPDATE_ABI`.
fn check_generated(path: &str, want: &str) {
    let file = root().join(path);
    if std::env::var_os("CACHEALLOC_UPDATE_ABI").is_some() {
        std::fs::write(&file, want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(&file).unwrap_or_default();
    if have != want {
        let line = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .map_or_else(
                || "their lengths differ".to_string(),
                |i| format!("first difference at line {}", i + 1),
            );
        panic!(
            "{path} is stale ({line}): the C ABI changed. Run \
             `CACHEALLOC_UPDATE_ABI=1 cargo test --lib abi_` and commit the result"
        );
    }
}

#[test]
fn abi_header_is_current() {
    check_generated(HEADER, &generate_header());
}

#[test]
fn abi_python_table_is_current() {
    check_generated(PY_TABLE, &generate_python_table(&generate_header()));
}

/// The constants the C++ allocator and Python read by name are in the
/// header with the values the Rust side uses.
#[test]
fn abi_header_carries_the_layout_constants() {
    use crate::capi_torch::*;
    let consts: BTreeMap<String, u64> = header_constants(&generate_header()).into_iter().collect();
    for (name, value) in [
        ("CACHEALLOC_MAX_DEVICES", crate::capi::MAX_DEVICES as u64),
        ("CACHEALLOC_STATS_LEN", CACHEALLOC_STATS_LEN as u64),
        (
            "CACHEALLOC_STATS_OVERSIZE_ALLOCATIONS",
            CACHEALLOC_STATS_OVERSIZE_ALLOCATIONS as u64,
        ),
        (
            "CACHEALLOC_STATS_MAX_SPLIT_SIZE",
            CACHEALLOC_STATS_MAX_SPLIT_SIZE as u64,
        ),
        ("CACHEALLOC_STAT_FIELDS", CACHEALLOC_STAT_FIELDS as u64),
        ("CACHEALLOC_SEGMENT_WORDS", CACHEALLOC_SEGMENT_WORDS as u64),
        ("CACHEALLOC_BLOCK_WORDS", CACHEALLOC_BLOCK_WORDS as u64),
        (
            "CACHEALLOC_BLOCK_STATE_ALLOCATED",
            CACHEALLOC_BLOCK_STATE_ALLOCATED,
        ),
    ] {
        assert_eq!(consts.get(name), Some(&value), "{name}");
    }
    for (array, start) in STAT_ARRAY_STARTS {
        let name = format!("CACHEALLOC_STATS_{}", array.to_uppercase());
        assert_eq!(consts.get(&name), Some(&(start as u64)), "{name}");
    }
    for (counter, slot) in STAT_COUNTERS {
        let name = format!("CACHEALLOC_STATS_{}", counter.to_uppercase());
        assert_eq!(consts.get(&name), Some(&(slot as u64)), "{name}");
    }
    assert!(
        consts.keys().all(|k| k.starts_with("CACHEALLOC_")),
        "every constant of the header is prefixed: {:?}",
        consts.keys().collect::<Vec<_>>()
    );
}

/// A function of the header: its return type and parameter types, each
/// with blanks normalised (`const char *`), a function pointer as `fn*`.
#[derive(Debug, PartialEq)]
struct CFunction {
    ret: String,
    params: Vec<String>,
}

/// Splits `s` at the commas outside parentheses and brackets.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// `const char *` for `const char*`, `const  char *` …: one blank between
/// words, `*` apart.
fn normalise_type(t: &str) -> String {
    t.replace('*', " * ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The type of a parameter declaration (`const uint64_t *words` → `const
/// uint64_t *`; a function pointer → `fn*`).
fn param_type(p: &str) -> String {
    let p = p.trim();
    if p.contains("(*") {
        return "fn*".into();
    }
    let cut = p
        .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    normalise_type(&p[..cut])
}

/// Every `cachealloc_*` function declared in `header`.
fn header_functions(header: &str) -> BTreeMap<String, CFunction> {
    let code: String = header
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !(t.starts_with("//")
                || t.starts_with('#')
                || t.starts_with("/*")
                || t.starts_with('*'))
        })
        .collect::<Vec<_>>()
        .join(" ");
    let mut out = BTreeMap::new();
    for decl in code.split(';') {
        let decl = decl.trim().trim_start_matches("extern \"C\" {").trim();
        let Some(open) = decl.find("cachealloc_") else {
            continue;
        };
        if decl.starts_with("typedef") {
            continue;
        }
        let Some(paren) = decl[open..].find('(').map(|i| open + i) else {
            continue;
        };
        let name = decl[open..paren].trim().to_string();
        let ret = normalise_type(&decl[..open]);
        let args = decl[paren + 1..].trim_end().strip_suffix(')').unwrap_or("");
        let params = if args.trim() == "void" {
            Vec::new()
        } else {
            split_top_level(args).into_iter().map(param_type).collect()
        };
        out.insert(name, CFunction { ret, params });
    }
    out
}

/// The `_SIGNATURES` table of the Python package: name → (return, arguments),
/// each a ctypes name (`c_int`, `POINTER(c_int64)`, `None`).
fn python_signatures(source: &str) -> BTreeMap<String, (String, Vec<String>)> {
    let start = source
        .find("_SIGNATURES = {")
        .expect("__init__.py has its _SIGNATURES table");
    let body = &source[start + "_SIGNATURES = {".len()..];
    let body = &body[..body.find("\n}").expect("the table ends with `}` alone")];
    let flat: String = body
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join(" ")
        .replace("ctypes.", "");
    let mut out = BTreeMap::new();
    for entry in split_top_level(&flat)
        .into_iter()
        .map(str::trim)
        .filter(|e| !e.is_empty())
    {
        let (name, rest) = entry
            .split_once(':')
            .unwrap_or_else(|| panic!("`{entry}` is not `\"name\": (restype, [argtypes])`"));
        let name = name.trim().trim_matches('"').to_string();
        let rest = rest
            .trim()
            .strip_prefix('(')
            .and_then(|r| r.strip_suffix(')'))
            .unwrap_or_else(|| panic!("{name}: not `(restype, [argtypes])`"));
        let (ret, args) = rest
            .split_once(',')
            .unwrap_or_else(|| panic!("{name}: no argument list"));
        let args = args
            .trim()
            .strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or_else(|| panic!("{name}: the argument types are not a [list]"));
        let args = split_top_level(args)
            .into_iter()
            .map(|a| a.split_whitespace().collect::<String>())
            .filter(|a| !a.is_empty())
            .collect();
        out.insert(name, (ret.trim().to_string(), args));
    }
    out
}

/// Whether the ctypes type `py` passes or returns the C type `c` correctly
/// (LP64 Linux). A string the library returns (`char *`) must be `c_void_p`
/// so that it can go back to `cachealloc_string_free`.
fn compatible(c: &str, py: &str, is_return: bool) -> bool {
    match c {
        "void" => py == "None",
        "int" => py == "c_int",
        "int64_t" => py == "c_int64" || py == "c_longlong",
        "uint64_t" => py == "c_uint64" || py == "c_ulonglong",
        "uint32_t" => py == "c_uint32",
        "size_t" => py == "c_size_t",
        "ptrdiff_t" => py == "c_ssize_t",
        "double" => py == "c_double",
        "char *" if is_return => py == "c_void_p",
        "const char *" => py == "c_char_p" || py == "c_void_p",
        "int64_t *" => py == "POINTER(c_int64)" || py == "c_void_p",
        "uint64_t *" | "const uint64_t *" => py == "POINTER(c_uint64)" || py == "c_void_p",
        "int *" => py == "POINTER(c_int)" || py == "c_void_p",
        "fn*" => py == "c_void_p",
        c if c.ends_with('*') => py == "c_void_p",
        _ => false,
    }
}

#[test]
fn abi_python_ctypes_table_matches_the_header() {
    let header = generate_header();
    let functions = header_functions(&header);
    assert!(
        functions.len() >= 30,
        "the parser found only {} functions: {:?}",
        functions.len(),
        functions.keys().collect::<Vec<_>>()
    );
    let source = std::fs::read_to_string(root().join(PY_INIT)).unwrap();
    let table = python_signatures(&source);
    assert!(table.len() >= 20, "{} entries parsed", table.len());
    let mut errors = Vec::new();
    for (name, (ret, args)) in &table {
        let Some(f) = functions.get(name) else {
            errors.push(format!("{name}: not in {HEADER}"));
            continue;
        };
        if !compatible(&f.ret, ret, true) {
            errors.push(format!("{name}: returns `{}`, ctypes says {ret}", f.ret));
        }
        if f.params.len() != args.len() {
            errors.push(format!(
                "{name}: {} parameters ({:?}), ctypes gives {}",
                f.params.len(),
                f.params,
                args.len()
            ));
            continue;
        }
        for (i, (c, py)) in f.params.iter().zip(args).enumerate() {
            if !compatible(c, py, false) {
                errors.push(format!("{name}: parameter {i} is `{c}`, ctypes says {py}"));
            }
        }
    }
    assert!(
        errors.is_empty(),
        "{PY_INIT} vs {HEADER}:\n{}",
        errors.join("\n")
    );
    // Every function of the plain ABI is in the table (the torch ABI is the
    // C++ allocator's; the table takes only what the package uses of it).
    for name in functions.keys() {
        if !name.starts_with("cachealloc_torch_") {
            assert!(table.contains_key(name), "{name} is missing from {PY_INIT}");
        }
    }
}

/// The checker itself: a wrong type, a missing or extra argument and an
/// unknown function are each caught.
#[test]
fn abi_python_table_checker_catches_mismatches() {
    let header = "int cachealloc_a(const void *h, size_t n);\n\
                  char *cachealloc_b(int device);\n\
                  void cachealloc_c(void (*f)(const char*, uint32_t));\n";
    let functions = header_functions(header);
    assert_eq!(
        functions["cachealloc_a"],
        CFunction {
            ret: "int".into(),
            params: vec!["const void *".into(), "size_t".into()]
        }
    );
    assert_eq!(functions["cachealloc_c"].params, vec!["fn*".to_string()]);
    let check = |py: &str| -> bool {
        let t = python_signatures(&format!("_SIGNATURES = {{\n{py}\n}}\n"));
        t.iter().all(|(name, (ret, args))| {
            functions.get(name).is_some_and(|f| {
                compatible(&f.ret, ret, true)
                    && f.params.len() == args.len()
                    && f.params
                        .iter()
                        .zip(args)
                        .all(|(c, p)| compatible(c, p, false))
            })
        })
    };
    assert!(check(
        "    \"cachealloc_a\": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),\n    \
         \"cachealloc_b\": (ctypes.c_void_p, [ctypes.c_int]),"
    ));
    assert!(!check(
        "    \"cachealloc_a\": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),"
    ));
    assert!(!check(
        "    \"cachealloc_a\": (ctypes.c_int, [ctypes.c_void_p]),"
    ));
    assert!(!check(
        "    \"cachealloc_b\": (ctypes.c_char_p, [ctypes.c_int]),"
    ));
    assert!(!check("    \"cachealloc_x\": (None, []),"));
}

/// The header compiles as C and as C++ (with every warning an error), where
/// a compiler is installed.
#[test]
fn abi_header_compiles_as_c_and_cpp() {
    let dir = std::env::temp_dir().join(format!("cachealloc-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let include = root().join("include");
    let mut compiled = 0;
    for (compiler, file, std) in [
        ("cc", "check.c", "-std=c11"),
        ("c++", "check.cpp", "-std=c++17"),
    ] {
        let src: PathBuf = dir.join(file);
        std::fs::write(
            &src,
            "#include <cachealloc.h>\n\
             int check(void* h) {\n\
             \x20 int64_t v[CACHEALLOC_STATS_LEN];\n\
             \x20 return cachealloc_torch_stats(h, v, CACHEALLOC_STATS_LEN) + \
             (int)v[CACHEALLOC_STATS_NUM_OOMS];\n\
             }\n",
        )
        .unwrap();
        let run = std::process::Command::new(compiler)
            .args([
                std,
                "-Wall",
                "-Wextra",
                "-Werror",
                "-pedantic",
                "-fsyntax-only",
                "-I",
            ])
            .arg(&include)
            .arg(&src)
            .output();
        match run {
            Err(e) => eprintln!("abi_header_compiles_as_c_and_cpp: no `{compiler}` ({e}); skipped"),
            Ok(out) => {
                assert!(
                    out.status.success(),
                    "{compiler} {std} rejects {HEADER}:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                compiled += 1;
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    eprintln!("abi_header_compiles_as_c_and_cpp: {compiled} of 2 compilers ran");
}
