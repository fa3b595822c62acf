//! The languages of the code runner: every language SandboxFusion lists (and C), each with its
//! source file, compile and run commands (POSIX `sh`, run in the run's directory), and the
//! shell test that tells whether a template has its toolchain.

/// How a language names its source file or entry point beyond the fixed name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Entry {
    /// The fixed `source`.
    Fixed,
    /// `<public class>.java` (the fixed name when the code has no public class).
    JavaPublicClass,
    /// `{main}` in the run command is the code's first `object`.
    ScalaObject,
    /// The code gets `<?php` in front when it lacks it.
    PhpTag,
}

/// A language the runner knows.
#[derive(Debug, Clone, Copy)]
pub(super) struct Lang {
    pub name: &'static str,
    /// Other names accepted.
    pub aliases: &'static [&'static str],
    pub source: &'static str,
    pub entry: Entry,
    pub compile: Option<&'static str>,
    pub run: &'static str,
    /// A shell test that succeeds when the template has the toolchain.
    pub probe: &'static str,
    /// The program a template without the toolchain lacks (named in the answer).
    pub tool: &'static str,
}

const fn lang(
    name: &'static str,
    source: &'static str,
    compile: Option<&'static str>,
    run: &'static str,
    tool: &'static str,
) -> Lang {
    Lang {
        name,
        aliases: &[],
        source,
        entry: Entry::Fixed,
        compile,
        run,
        probe: "",
        tool,
    }
}

/// Every language, in SandboxFusion's order (C, which it lacks, after C++). A `probe` left
/// empty is `command -v <tool>`.
pub(super) const LANGS: &[Lang] = &[
    Lang {
        aliases: &["python3"],
        probe: "[ -x /usr/bin/python3 ]",
        ..lang(
            "python",
            "main.py",
            None,
            "exec /usr/bin/python3 main.py",
            "python3",
        )
    },
    Lang {
        probe: "python3 -c 'import pytest'",
        ..lang(
            "pytest",
            "test_main.py",
            None,
            "exec python3 -m pytest -p no:cacheprovider test_main.py",
            "pytest",
        )
    },
    Lang {
        aliases: &["c++"],
        ..lang(
            "cpp",
            "main.cpp",
            Some("g++ -O2 -std=c++17 -o main main.cpp -lm -lpthread"),
            "exec ./main",
            "g++",
        )
    },
    lang(
        "c",
        "main.c",
        Some("gcc -O2 -o main main.c -lm"),
        "exec ./main",
        "gcc",
    ),
    Lang {
        aliases: &["javascript", "node", "js"],
        ..lang("nodejs", "main.js", None, "exec node main.js", "node")
    },
    lang(
        "go",
        "main.go",
        Some("go build -o main main.go"),
        "exec ./main",
        "go",
    ),
    lang(
        "go_test",
        "main_test.go",
        None,
        "exec go test main_test.go",
        "go",
    ),
    lang(
        "java",
        "Main.java",
        Some("javac -cp '.:*' Main.java"),
        "exec java -cp '.:*' -ea Main",
        "javac",
    ),
    // The JUnit console launcher is Debian's `junit5`.
    Lang {
        entry: Entry::JavaPublicClass,
        probe: "command -v javac && [ -f /usr/share/java/junit-platform-console-standalone.jar ]",
        ..lang(
            "junit",
            "Main.java",
            Some("javac -cp '.:/usr/share/java/junit-platform-console-standalone.jar:*' *.java"),
            concat!(
                "cp=.; for j in *.jar; do [ -f \"$j\" ] && cp=\"$cp:$j\"; done; ",
                "exec java -jar /usr/share/java/junit-platform-console-standalone.jar ",
                "--disable-banner --disable-ansi-colors --class-path \"$cp\" --scan-class-path"
            ),
            "junit-platform-console-standalone.jar",
        )
    },
    Lang {
        entry: Entry::PhpTag,
        ..lang("php", "main.php", None, "exec php -f main.php", "php")
    },
    Lang {
        probe: "command -v mcs && command -v mono",
        ..lang(
            "csharp",
            "main.cs",
            Some("mcs -out:main.exe main.cs"),
            "exec mono main.exe",
            "mcs",
        )
    },
    lang("bash", "main.sh", None, "exec bash main.sh", "bash"),
    Lang {
        aliases: &["ts"],
        probe: "command -v node && { command -v tsx || command -v tsc; }",
        ..lang(
            "typescript",
            "main.ts",
            None,
            // tsx runs TypeScript as is; without it tsc emits JavaScript (type errors do not
            // stop it, as they do not stop tsx) and node runs that.
            concat!(
                "command -v tsx >/dev/null && exec tsx main.ts; ",
                "tsc --target es2020 --module commonjs --skipLibCheck main.ts >.tsc.out 2>&1; ",
                "[ -f main.js ] || { cat .tsc.out >&2; exit 1; }; exec node main.js"
            ),
            "tsx",
        )
    },
    Lang {
        probe: "command -v sqlite3",
        ..lang(
            "sql",
            "main.sql",
            None,
            "exec sqlite3 -bail -batch :memory: < main.sql",
            "sqlite3",
        )
    },
    lang(
        "rust",
        "main.rs",
        Some("rustc -O -o main main.rs"),
        "exec ./main",
        "rustc",
    ),
    Lang {
        // SandboxFusion builds the project its files make (a CMakeLists.txt) and runs
        // build/main; the code itself is written to main.cu.
        probe: "command -v nvcc && command -v cmake",
        ..lang(
            "cuda",
            "main.cu",
            Some("mkdir -p build && cd build && cmake .. && make -j 4"),
            "exec ./build/main",
            "nvcc",
        )
    },
    lang("lua", "main.lua", None, "exec lua main.lua", "lua"),
    lang("R", "main.R", None, "exec Rscript main.R", "Rscript"),
    lang("perl", "main.pl", None, "exec perl main.pl", "perl"),
    Lang {
        probe: "command -v dmd || command -v ldmd2 || command -v gdc",
        ..lang(
            "D_ut",
            "main.d",
            Some(concat!(
                "if command -v dmd >/dev/null; then dmd main.d -unittest -of=main; ",
                "elif command -v ldmd2 >/dev/null; then ldmd2 main.d -unittest -of=main; ",
                "else gdc -funittest -o main main.d; fi"
            )),
            "exec ./main",
            "dmd",
        )
    },
    lang("ruby", "main.rb", None, "exec ruby main.rb", "ruby"),
    Lang {
        entry: Entry::ScalaObject,
        ..lang(
            "scala",
            "main.scala",
            Some("scalac main.scala"),
            "exec scala -cp . {main}",
            "scalac",
        )
    },
    lang("julia", "main.jl", None, "exec julia main.jl", "julia"),
    Lang {
        probe: "command -v kotlinc || command -v kotlin",
        ..lang(
            "kotlin_script",
            "main.kts",
            None,
            "command -v kotlinc >/dev/null && exec kotlinc -script main.kts; exec kotlin main.kts",
            "kotlinc",
        )
    },
    Lang {
        probe: "command -v jest && command -v tsc",
        ..lang(
            "jest",
            "main.test.ts",
            Some(concat!(
                "tsc --target es2020 --module commonjs --skipLibCheck main.test.ts >.tsc.out 2>&1; ",
                "[ -f main.test.js ] || { cat .tsc.out >&2; exit 1; }"
            )),
            "exec jest --ci --rootDir . main.test.js",
            "jest",
        )
    },
    Lang {
        probe: "command -v iverilog && command -v vvp",
        ..lang(
            "verilog",
            "main.sv",
            Some("iverilog -Wall -Winfloop -Wno-timescale -g2012 -s tb -o test.vvp main.sv"),
            "exec vvp -n test.vvp",
            "iverilog",
        )
    },
    // A project (its lakefile among the files) is built by lake; a lone file is checked by
    // lean.
    lang(
        "lean",
        "Main.lean",
        None,
        "[ -f lakefile.lean ] && exec lake build; exec lean Main.lean",
        "lean",
    ),
    lang(
        "swift",
        "main.swift",
        Some("swiftc main.swift -o main"),
        "exec ./main",
        "swiftc",
    ),
    lang("racket", "main.rkt", None, "exec racket main.rkt", "racket"),
    Lang {
        // SandboxFusion runs compile.py then run.py of the files.
        probe: "command -v python3",
        ..lang(
            "python_gpu",
            "main.py",
            Some("python3 compile.py"),
            "exec python3 run.py",
            "python3",
        )
    },
];

/// The language SandboxFusion calls `name` (or one of its aliases).
pub(super) fn find(name: &str) -> Option<&'static Lang> {
    LANGS
        .iter()
        .find(|l| l.name == name || l.aliases.contains(&name))
}

/// The names of every language, comma-separated.
pub(super) fn known() -> String {
    LANGS.iter().map(|l| l.name).collect::<Vec<_>>().join(", ")
}

/// The shell script that prints the name of each language whose toolchain is present.
pub(super) fn probe_script() -> String {
    LANGS
        .iter()
        .map(|l| {
            let test = if l.probe.is_empty() {
                format!("command -v {}", l.tool)
            } else {
                l.probe.to_owned()
            };
            format!("{{ {test}; }} >/dev/null 2>&1 && echo {}\n", l.name)
        })
        .collect()
}

/// What one run writes and runs: the source file's name and content, the compile and run
/// commands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Program {
    pub source: String,
    pub code: String,
    pub compile: Option<String>,
    pub run: String,
}

impl Lang {
    /// The program that runs `code` in this language.
    pub fn program(&self, code: &str) -> Program {
        let mut p = Program {
            source: self.source.to_owned(),
            code: code.to_owned(),
            compile: self.compile.map(str::to_owned),
            run: self.run.to_owned(),
        };
        match self.entry {
            Entry::Fixed => {}
            Entry::JavaPublicClass => {
                if let Some(class) = declared_name(code, "class", Some("public")) {
                    p.source = format!("{class}.java");
                }
            }
            Entry::ScalaObject => match declared_name(code, "object", None) {
                Some(obj) => p.run = p.run.replace("{main}", &obj),
                None => {
                    p.compile = Some("echo 'Object name not found.' >&2; exit 1".to_owned());
                }
            },
            Entry::PhpTag => {
                let rest = code.trim_start();
                if !rest.starts_with("<?php") {
                    p.code = format!("<?php\n{rest}");
                }
            }
        }
        p
    }
}

/// The identifier after the first `keyword` (preceded by `modifier` and other modifiers when
/// given) in `code`: `public final class Foo` gives `Foo` for ("class", Some("public")).
fn declared_name(code: &str, keyword: &str, modifier: Option<&str>) -> Option<String> {
    let words: Vec<&str> = code
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$'))
        .filter(|w| !w.is_empty())
        .collect();
    const MODIFIERS: &[&str] = &["public", "final", "abstract", "static", "strictfp", "case"];
    for (i, w) in words.iter().enumerate() {
        if *w != keyword {
            continue;
        }
        let name = words.get(i + 1)?;
        let ok = match modifier {
            None => true,
            Some(m) => words[..i]
                .iter()
                .rev()
                .take_while(|w| MODIFIERS.contains(w))
                .any(|w| *w == m),
        };
        if ok && !name.starts_with(|c: char| c.is_ascii_digit()) {
            return Some((*name).to_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The languages SandboxFusion's server accepts (its `Language` literal).
    const FUSION: &[&str] = &[
        "python",
        "cpp",
        "nodejs",
        "go",
        "go_test",
        "java",
        "php",
        "csharp",
        "bash",
        "typescript",
        "sql",
        "rust",
        "cuda",
        "lua",
        "R",
        "perl",
        "D_ut",
        "ruby",
        "scala",
        "julia",
        "pytest",
        "junit",
        "kotlin_script",
        "jest",
        "verilog",
        "python_gpu",
        "lean",
        "swift",
        "racket",
    ];

    #[test]
    fn every_sandbox_fusion_language_is_known() {
        assert_eq!(FUSION.len(), 29);
        for name in FUSION {
            assert_eq!(find(name).map(|l| l.name), Some(*name));
        }
        assert_eq!(LANGS.len(), FUSION.len() + 1);
        assert!(find("cobol").is_none());
        assert_eq!(find("js").map(|l| l.name), Some("nodejs"));
    }

    #[test]
    fn the_probe_script_tests_each_language_once() {
        let s = probe_script();
        assert_eq!(s.lines().count(), LANGS.len());
        assert!(
            s.contains("{ command -v go; } >/dev/null 2>&1 && echo go\n"),
            "{s}"
        );
    }

    #[test]
    fn junit_names_the_file_after_the_public_class() {
        let j = find("junit").expect("junit");
        let code = "import org.junit.jupiter.api.Test;\nclass Helper {}\npublic final class CalcTest {\n @Test void t() {}\n}";
        assert_eq!(j.program(code).source, "CalcTest.java");
        assert_eq!(j.program("class A {}").source, "Main.java");
    }

    #[test]
    fn scala_runs_the_first_object_or_fails_to_compile() {
        let s = find("scala").expect("scala");
        let p = s.program("object Hello extends Node { println(1) }");
        assert_eq!(p.run, "exec scala -cp . Hello");
        let p = s.program("class X");
        assert!(p
            .compile
            .unwrap_or_default()
            .contains("Object name not found"));
    }

    #[test]
    fn php_gets_its_open_tag() {
        let p = find("php").expect("php");
        assert_eq!(p.program("  echo 1;").code, "<?php\necho 1;");
        assert_eq!(p.program("<?php echo 1;").code, "<?php echo 1;");
    }
}
