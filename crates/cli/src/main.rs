//! `dsec`: the command line of the dsec sandbox infrastructure.
#![forbid(unsafe_code)]

mod admin_cmd;
mod bench;
mod build_cmd;
mod client;
mod cluster_cmd;
mod output;
mod sandbox_cmd;
mod snapshot_cmd;
mod trajectory_cmd;
mod units;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use dsec_api::exec::{ExecRequest, ExecStatus};
use dsec_node::capacity::NodeCapacity;
use dsec_node::sandbox::{Limits, SandboxSpec, Substrate};
use dsec_node::substrate::{Runtime, RuntimeConfig};

/// dsec: elastic sandboxes for agentic training.
#[derive(Debug, Parser)]
#[command(name = "dsec", version, about, after_long_help = client::EXIT_CODES)]
struct Cli {
    /// Persistent data directory (layers, templates).
    #[arg(
        long,
        global = true,
        env = "DSEC_DATA_DIR",
        default_value = "/var/lib/dsec"
    )]
    data_dir: PathBuf,
    /// Runtime directory (supervisor sockets, stage dir).
    #[arg(long, global = true, env = "DSEC_RUN_DIR", default_value = "/run/dsec")]
    run_dir: PathBuf,
    /// Address of the daemon (`dsec server`) for the sandbox, pool and tenant commands.
    #[arg(
        long,
        global = true,
        env = "DSEC_URL",
        default_value = "http://127.0.0.1:7700"
    )]
    url: String,
    /// API key for the daemon. Default: the admin key in `<data-dir>/admin.key` when readable.
    #[arg(long, global = true, env = "DSEC_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the node daemon: the HTTP API (docs/api.md) over SQLite state in the data dir.
    Server(ServerArgs),
    /// Run a cluster gateway: the same API, placed and routed over the nodes registered in etcd.
    Gateway(cluster_cmd::GatewayArgs),
    /// Operate a cluster: its nodes' status, draining a node.
    Cluster {
        #[command(subcommand)]
        command: cluster_cmd::ClusterCmd,
    },
    /// Create a sandbox, run one command in it, print its output, destroy it and exit with the
    /// command's exit code.
    Run(RunArgs),
    /// List and import templates of the local store; upload them to and remove them from a
    /// running daemon (root filesystem tarballs, OCI image layouts, `docker save` tarballs).
    #[command(after_long_help = client::EXIT_CODES)]
    Template {
        #[command(subcommand)]
        command: TemplateCmd,
    },
    /// Measure the substrate and print JSON.
    Bench(bench::BenchArgs),
    /// Create, list, run commands in and destroy sandboxes of a running daemon (--url).
    #[command(after_long_help = client::EXIT_CODES)]
    Sandbox {
        #[command(subcommand)]
        command: sandbox_cmd::SandboxCmd,
    },
    /// List and size the warm pools of a running daemon.
    #[command(after_long_help = client::EXIT_CODES)]
    Pool {
        #[command(subcommand)]
        command: admin_cmd::PoolCmd,
    },
    /// Create and list tenants of a running daemon (admin key).
    #[command(after_long_help = client::EXIT_CODES)]
    Tenant {
        #[command(subcommand)]
        command: admin_cmd::TenantCmd,
    },
    /// Prepare the VM substrates: install QEMU and the guest kernel from Debian's packages,
    /// build the initramfs and the template's root image, boot and snapshot the template.
    Vm {
        #[command(subcommand)]
        command: VmCmd,
    },
    /// Snapshot, fork and restore sandboxes of a running daemon; list, walk and delete
    /// snapshots.
    #[command(after_long_help = client::EXIT_CODES)]
    Snapshot {
        #[command(subcommand)]
        command: snapshot_cmd::SnapshotCmd,
    },
    /// List, show, annotate and export trajectories of a running daemon.
    #[command(after_long_help = client::EXIT_CODES)]
    Trajectory {
        #[command(subcommand)]
        command: trajectory_cmd::TrajectoryCmd,
    },
}

#[derive(Debug, Subcommand)]
enum VmCmd {
    /// Make everything a VM sandbox of TEMPLATE needs, so that the first create is a restore
    /// (prints what was prepared as JSON). Idempotent; cached in DSEC_VM_CACHE
    /// (default /var/cache/dsec/vm).
    Prepare {
        /// Template.
        #[arg(long, default_value = "host")]
        template: String,
        /// Substrates to prepare (microvm, vm); both by default.
        #[arg(long = "substrate")]
        substrates: Vec<String>,
        /// Guest memory (the snapshot is made for one memory size: the default limit).
        #[arg(long, default_value = "512M", value_parser = units::parse_bytes)]
        memory: u64,
    },
    /// Remove every VM cache entry (snapshot, root image, initramfs) no process uses, and
    /// entries of earlier formats; prints what went and the bytes freed as JSON.
    Gc {
        /// Remove only the least recently used unused entries, until the cache holds at most
        /// this (and entries of earlier formats).
        #[arg(long, value_parser = units::parse_bytes)]
        max_bytes: Option<u64>,
    },
}

#[derive(Debug, clap::Args)]
struct ServerArgs {
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    #[arg(long, env = "DSEC_LISTEN", default_value = "127.0.0.1:7700")]
    listen: std::net::SocketAddr,
    /// Seconds in-flight requests get after SIGTERM.
    #[arg(long, default_value_t = 30)]
    drain_seconds: u64,
    /// On SIGTERM/SIGINT, destroy every sandbox of the node (all tenants, pools, runner) before
    /// exiting, instead of leaving them running for the next start to adopt.
    #[arg(long)]
    shutdown_sandboxes: bool,
    /// Ready sandboxes of the `host` template kept at least (the pool grows with demand).
    #[arg(long, env = "DSEC_POOL_MIN", default_value_t = 0)]
    pool_min: usize,
    /// Extra regular expressions masked in the trajectory log (repeatable; API-key and token
    /// patterns of common providers are always masked).
    #[arg(long = "redact")]
    redact: Vec<String>,
    /// Delete trajectory log segments older than this many hours (never the active one).
    #[arg(long)]
    log_retention_hours: Option<u64>,
    /// Keep at most this many bytes of trajectory log (oldest segments go first).
    #[arg(long, value_parser = units::parse_bytes)]
    log_retention_bytes: Option<u64>,
    /// Size at which the trajectory log starts a new segment (default 64M).
    #[arg(long, value_parser = units::parse_bytes)]
    log_segment_bytes: Option<u64>,
    /// Seconds after which a finished trajectory's records are compacted out of the log.
    #[arg(long, default_value_t = 3600)]
    compact_finished_after: u64,
    /// Most sandboxes this node holds at once, pools included.
    #[arg(long, env = "DSEC_MAX_SANDBOXES", default_value_t = 10_000)]
    max_sandboxes: usize,
    /// Ready sandboxes of the `host` template kept at most (0: no pool).
    #[arg(long, env = "DSEC_POOL_MAX", default_value_t = 64)]
    pool_max: usize,
    /// Serve the code runner (`/run_code`, `/v1/run`, …) without an API key, as the
    /// `anonymous` tenant (at most 8 runs in flight). Only on a loopback listener.
    #[arg(long)]
    anonymous_run: bool,
    /// Python zygotes (function-substrate sandboxes) each template keeps warm.
    #[arg(long, default_value_t = 4)]
    run_zygotes: usize,
    /// Most Python zygotes per template: beyond `--run-zygotes`, more start only while calls
    /// wait behind long ones, and go again once unused for `--run-zygote-idle-secs`.
    #[arg(long, default_value_t = 32)]
    run_zygotes_max: usize,
    /// Seconds a zygote beyond `--run-zygotes` stays idle before it is destroyed.
    #[arg(long, default_value_t = 30)]
    run_zygote_idle_secs: u64,
    /// pids.max of each Python zygote sandbox: a call may have what the agent, driver and
    /// zygote leave (58 processes and threads at 64). Bounds what a fork bomb costs other calls.
    #[arg(long, default_value_t = 64)]
    run_pids_max: u64,
    /// Run Python zygote sandboxes in a user namespace, so that a call's process limit refuses
    /// a fork before its address space is copied (`--run-userns false` to turn off).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    run_userns: bool,
    /// Modules each Python zygote imports once (comma-separated; default: common stdlib).
    #[arg(long, value_delimiter = ',')]
    run_preload: Option<Vec<String>>,
    /// The template of a run that names none (SandboxFusion's clients cannot name one): e.g.
    /// the `code-runner` template of scripts/build-code-runner-template.sh.
    #[arg(long, default_value = "host")]
    run_template: String,
    /// Bound on the VM cache (DSEC_VM_CACHE, default /var/cache/dsec/vm) on disk: past it the
    /// least recently used entries no VM uses are removed (besides those unused for 24 h).
    #[arg(long, env = "DSEC_VM_CACHE_MAX_BYTES", value_parser = units::parse_bytes)]
    vm_cache_max_bytes: Option<u64>,
    /// Join the cluster of these etcd endpoints (comma-separated URLs); needs --node-name.
    /// Without it the node stands alone.
    #[arg(long, env = "DSEC_ETCD", requires = "node_name")]
    etcd: Option<String>,
    /// This node's name in the cluster (unique).
    #[arg(long, env = "DSEC_NODE_NAME")]
    node_name: Option<String>,
    /// The URL gateways reach this node's API at (e.g. http://10.0.0.5:7700; default: http://
    /// and the address it listens on).
    #[arg(long, env = "DSEC_ADVERTISE")]
    advertise: Option<String>,
    /// In a cluster: the origin store of template layers, a directory every node mounts (NFS,
    /// a shared volume) or an S3-compatible bucket, `s3://bucket/prefix` (AWS_ENDPOINT_URL,
    /// AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY). Without it templates move only
    /// from the nodes that hold them.
    #[arg(long, env = "DSEC_TEMPLATE_STORE", requires = "etcd")]
    template_store: Option<String>,
    /// The DNS resolver (ip:port) names a sandbox's egress policy allows are resolved with
    /// (default: the host's first nameserver in /etc/resolv.conf).
    #[arg(long, env = "DSEC_EGRESS_RESOLVER")]
    egress_resolver: Option<std::net::SocketAddr>,
    /// The subnet (a.b.c.d/len) of sandboxes' egress addresses (default: a free /19 of
    /// 10.224.0.0/11, one per node on a host).
    #[arg(long, env = "DSEC_EGRESS_SUBNET", value_parser = parse_subnet)]
    egress_subnet: Option<(std::net::Ipv4Addr, u8)>,
    /// Networks (a.b.c.d[/len], comma-separated or repeated) no sandbox reaches whatever its
    /// policy, like link-local metadata and the node itself: the operator's own private
    /// networks, say. Only a policy's `reserved` rules, allowed by an admin, reach them.
    #[arg(long, env = "DSEC_EGRESS_NEVER", value_delimiter = ',', value_parser = parse_net)]
    egress_never: Vec<(std::net::Ipv4Addr, u8)>,
}

/// Where a template comes from: its name and its image.
#[derive(Debug, clap::Args)]
struct TemplateSource {
    /// Template name.
    name: String,
    /// A root filesystem (tarball, or directory for `import`), an OCI image layout (directory
    /// or tar) or a `docker save` tar.
    path: PathBuf,
    /// The image is a plain root filesystem.
    #[arg(long, conflicts_with = "oci")]
    rootfs: bool,
    /// The image is an OCI image layout or a `docker save` archive.
    #[arg(long)]
    oci: bool,
}

#[derive(Debug, Subcommand)]
enum TemplateCmd {
    /// List templates.
    List,
    /// Import a template into the local store (--data-dir). The format is told from the
    /// archive's top-level names unless --rootfs or --oci says it.
    Import(TemplateSource),
    /// Build a template on a running daemon (admin key) from a Dockerfile: FROM (a template of
    /// the daemon), RUN, COPY/ADD (local files), ENV, WORKDIR, USER, ARG, LABEL; each step a
    /// layer, cached by (the steps before, the instruction, the copied files' digests).
    Build(build_cmd::BuildArgs),
    /// Upload a template to a running daemon (admin key), with a progress bar on stderr. The
    /// format is told from the tarball's top-level names unless --rootfs or --oci says it.
    Push(TemplateSource),
    /// Remove a template of a running daemon (admin key), or with --local of the local store,
    /// and the layers no other template uses.
    Rm {
        /// Template name.
        name: String,
        /// Remove it from the local store (--data-dir) of a node whose daemon is stopped,
        /// instead of through the daemon; refused while sandboxes run on it (--run-dir).
        #[arg(long)]
        local: bool,
    },
}

/// The format of an archive to import: as the flags say, else told from its content.
fn archive_format(
    path: &std::path::Path,
    rootfs: bool,
    oci: bool,
) -> anyhow::Result<dsec_node::template::ImageFormat> {
    use dsec_node::template::ImageFormat;
    if rootfs {
        return Ok(ImageFormat::Rootfs);
    }
    if oci {
        return Ok(ImageFormat::OciLayout);
    }
    if path.is_dir() {
        return Ok(dsec_node::template::detect_dir(path));
    }
    let f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let format = dsec_node::template::detect_archive(
        std::io::BufReader::new(f),
        &dsec_node::template::ImportLimits::default(),
    )?;
    eprintln!(
        "{}: {} (--rootfs or --oci to say otherwise)",
        path.display(),
        match format {
            ImageFormat::OciLayout => "an OCI image layout",
            ImageFormat::DockerSave => "a docker save archive",
            ImageFormat::Rootfs => "a root filesystem tarball",
        }
    );
    Ok(format)
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Template to create the sandbox from.
    #[arg(long, default_value = "host")]
    template: String,
    /// Memory limit (e.g. 256M, 1G).
    #[arg(long, default_value = "512M", value_parser = units::parse_bytes)]
    memory: u64,
    /// CPU cap in CPUs (e.g. 0.5, 2). Without it the sandbox gets a fair share, no cap.
    #[arg(long)]
    cpus: Option<f64>,
    /// Wall-clock timeout (e.g. 500ms, 10s, 2m).
    #[arg(long, default_value = "60s", value_parser = units::parse_duration_ms)]
    timeout: u64,
    /// Writable-layer size (the disk quota).
    #[arg(long, default_value = "1G", value_parser = units::parse_bytes)]
    disk: u64,
    /// Most processes.
    #[arg(long, default_value_t = 256)]
    pids: u64,
    /// Environment variable for the command (KEY=VALUE), repeatable.
    #[arg(long = "env", short = 'e', value_parser = units::parse_env)]
    env: Vec<(String, String)>,
    /// Make the whole root writable (writes land in the private layer).
    #[arg(long)]
    writable_root: bool,
    /// Map root inside the sandbox to an unprivileged host uid (user namespace).
    #[arg(long)]
    userns: bool,
    /// Substrate: container, microvm or vm.
    #[arg(long, default_value = "container", value_parser = parse_substrate)]
    substrate: Substrate,
    /// Print the full result as JSON instead of the command's output.
    #[arg(long)]
    json: bool,
    /// The command and its arguments.
    #[arg(required = true, last = true)]
    command: Vec<String>,
}

fn parse_substrate(s: &str) -> Result<Substrate, String> {
    Substrate::parse(s).ok_or_else(|| format!("unknown substrate {s:?} (container, microvm, vm)"))
}

fn vm(cli: &Cli, cmd: &VmCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        VmCmd::Prepare {
            template,
            substrates,
            memory,
        } => vm_prepare(cli, template, substrates, *memory),
        VmCmd::Gc { max_bytes } => {
            let cache = Runtime::vm_cache_dir();
            let report = dsec_node::substrate::vm::gc_unused(&cache, *max_bytes)
                .with_context(|| format!("garbage-collect {}", cache.display()))?;
            let out = serde_json::json!({
                "cache": cache,
                "bytes_freed": report.bytes_freed,
                "removed": report.removed,
                "kept": report.kept,
                "kept_bytes": report.kept_bytes,
                "in_use": report.in_use,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn vm_prepare(
    cli: &Cli,
    template: &str,
    substrates: &[String],
    memory: u64,
) -> anyhow::Result<ExitCode> {
    let kinds: Vec<Substrate> = if substrates.is_empty() {
        vec![Substrate::Microvm, Substrate::Vm]
    } else {
        substrates
            .iter()
            .map(|s| {
                parse_substrate(s)
                    .map_err(anyhow::Error::msg)
                    .and_then(|k| {
                        if k.is_vm() {
                            Ok(k)
                        } else {
                            anyhow::bail!("{s} is not a VM substrate")
                        }
                    })
            })
            .collect::<anyhow::Result<_>>()?
    };
    let rt = runtime(cli)?;
    let mut out = Vec::new();
    for kind in kinds {
        let t0 = std::time::Instant::now();
        let spec = SandboxSpec {
            template: template.to_owned(),
            substrate: kind,
            limits: rt
                .capacity()
                .admit(Limits {
                    memory_max: memory,
                    ..Limits::default()
                })
                .context("the VM's memory")?,
            ..SandboxSpec::default()
        };
        let progress = output::PhaseReport::new(kind.name());
        let (vms, snap) = rt
            .vm_snapshot_observed(&spec, &|e| progress.event(e))
            .with_context(|| format!("prepare {}", kind.name()))?;
        out.push(serde_json::json!({
            "substrate": kind.name(),
            "template": template,
            "accel": vms.accel().name(),
            "qemu": vms.qemu_version(),
            "kernel": vms.kernel_version(),
            "memory_mib": snap.key().memory_mib,
            "vcpus": snap.key().vcpus,
            "boot_ms": snap.boot_ms,
            "save_ms": snap.save_ms,
            "took_ms": t0.elapsed().as_millis() as u64,
            "cache": vms.cache_dir(),
        }));
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(ExitCode::SUCCESS)
}

fn runtime(cli: &Cli) -> anyhow::Result<Runtime> {
    let mut cfg = RuntimeConfig::from_env().context("locate dsec binaries")?;
    cfg.data_dir = cli.data_dir.clone();
    cfg.run_dir = cli.run_dir.clone();
    Runtime::start(cfg).context("start the container runtime (dsec needs root)")
}

fn run(cli: &Cli, args: &RunArgs) -> anyhow::Result<ExitCode> {
    let limits = Limits {
        memory_max: args.memory,
        cpu_max: args.cpus,
        cpu_weight: args
            .cpus
            .map_or(100, |c| ((c * 100.0) as u64).clamp(1, 10000)),
        disk_bytes: args.disk,
        file_size_max: args.disk,
        pids_max: args.pids,
        ..Limits::default()
    };
    // Limits beyond this machine are a usage error, found before anything is made.
    let capacity = NodeCapacity::detect().context("read what this machine has")?;
    let limits = match capacity.admit(limits) {
        Ok(admitted) => admitted,
        Err(e) => {
            eprintln!("dsec: invalid limits: {e}");
            return Ok(ExitCode::from(client::EXIT_USAGE));
        }
    };
    let spec = SandboxSpec {
        template: args.template.clone(),
        limits,
        env: args.env.iter().cloned().collect(),
        writable_root: args.writable_root,
        userns: args.userns,
        substrate: args.substrate,
        ..SandboxSpec::default()
    };
    let rt = runtime(cli)?;
    if spec.substrate.is_vm() {
        // The first VM of a host prepares its template (a minute or more): say so as it goes.
        let report = output::PhaseReport::new(spec.substrate.name());
        rt.set_vm_settings(dsec_node::substrate::VmSettings {
            cache_max_bytes: None,
            observer: Some(std::sync::Arc::new(move |_: &str, e| report.event(e))),
        });
    }
    let (mut sb, _) = rt.create(&spec).context("create sandbox")?;
    let mut req = ExecRequest::argv(args.command.clone());
    req.timeout_ms = Some(args.timeout);
    req.stream = !args.json;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let result = sb.exec(&rt, &req, &[], |stream, bytes| {
        let _ = match stream {
            dsec_api::exec::Stream::Stdout => stdout.write_all(bytes),
            dsec_api::exec::Stream::Stderr => stderr.write_all(bytes),
        };
    });
    let destroyed = sb.destroy(&rt);
    let result = result.context("run command")?;
    destroyed.context("destroy sandbox")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    }
    let code = match result.status {
        ExecStatus::Ok => 0,
        ExecStatus::NonzeroExit => result.exit_code.unwrap_or(1),
        ExecStatus::Timeout => {
            eprintln!("dsec: command timed out after {} ms", args.timeout);
            124
        }
        ExecStatus::Oom => {
            eprintln!(
                "dsec: command was killed: out of memory (limit {} bytes)",
                args.memory
            );
            137
        }
        ExecStatus::OutputLimit => {
            eprintln!("dsec: command was killed: output limit exceeded");
            125
        }
        ExecStatus::Killed => 128 + result.signal.unwrap_or(9),
    };
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

/// Counts bytes read and draws `[#####     ] 45% 12.0/26.7 MiB` on stderr (at most every 100 ms).
struct Progress<R> {
    inner: R,
    done: u64,
    total: u64,
    last: std::time::Instant,
}

impl<R> Progress<R> {
    fn draw(&self, force: bool) {
        let pct = self
            .done
            .saturating_mul(100)
            .checked_div(self.total)
            .unwrap_or(100)
            .min(100);
        let filled = (pct / 5) as usize;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let mut e = std::io::stderr().lock();
        let _ = write!(
            e,
            "\r[{}{}] {pct:>3}% {:.1}/{:.1} MiB",
            "#".repeat(filled),
            " ".repeat(20 - filled.min(20)),
            mib(self.done),
            mib(self.total)
        );
        if force {
            let _ = writeln!(e);
        }
    }
}

impl<R: std::io::Read> std::io::Read for Progress<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.done += n as u64;
        if self.last.elapsed() >= std::time::Duration::from_millis(100) {
            self.last = std::time::Instant::now();
            self.draw(false);
        }
        Ok(n)
    }
}

fn template_push(
    c: &client::Client,
    name: &str,
    path: &std::path::Path,
    format: dsec_node::template::ImageFormat,
) -> Result<ExitCode, client::ClientError> {
    let f = std::fs::File::open(path).map_err(|source| client::ClientError::Local {
        what: format!("open {}", path.display()),
        source,
    })?;
    let total = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut reader = Progress {
        inner: f,
        done: 0,
        total,
        last: std::time::Instant::now(),
    };
    let format = match format {
        dsec_node::template::ImageFormat::Rootfs => "rootfs",
        _ => "oci",
    };
    let mut resp = c.send_reader(
        "/v1/templates",
        &[("name", name), ("format", format)],
        &mut reader,
        "application/x-tar",
    )?;
    reader.draw(true);
    let v: serde_json::Value = resp
        .body_mut()
        .read_json()
        .map_err(|e| c.transport("POST", "/v1/templates", e))?;
    println!(
        "imported {} ({} layer(s))",
        v["name"].as_str().unwrap_or(name),
        v["layers"].as_array().map_or(0, Vec::len)
    );
    Ok(ExitCode::SUCCESS)
}

fn template(cli: &Cli, cmd: &TemplateCmd) -> anyhow::Result<ExitCode> {
    let store =
        dsec_node::template::TemplateStore::open(&cli.data_dir).context("open template store")?;
    match cmd {
        TemplateCmd::List => {
            for t in store.list()? {
                println!("{}\t{} layer(s)", t.name, t.layers.len());
            }
        }
        TemplateCmd::Import(TemplateSource {
            name,
            path,
            rootfs,
            oci,
        }) => {
            use dsec_node::template::{ImageFormat, OciSource, TemplateError};
            let limits = dsec_node::template::ImportLimits::default();
            let format = archive_format(path, *rootfs, *oci)?;
            let open =
                || std::fs::File::open(path).with_context(|| format!("open {}", path.display()));
            let t = match format {
                ImageFormat::Rootfs if path.is_dir() => {
                    return Err(TemplateError::InvalidImage {
                        reason: format!(
                            "{} is a directory but not an image layout (no oci-layout or \
                             manifest.json); import a root filesystem as a tarball: \
                             `tar -C {} -cf rootfs.tar .`",
                            path.display(),
                            path.display()
                        ),
                    }
                    .into())
                }
                ImageFormat::Rootfs => store.import_rootfs_tar(name, open()?, &limits)?,
                _ if path.is_dir() => store.import_oci(name, OciSource::Dir(path), &limits)?,
                _ => store.import_oci(name, OciSource::Tar(&mut open()?), &limits)?,
            };
            println!("imported {} ({} layer(s))", t.name, t.layers.len());
        }
        TemplateCmd::Rm { name, local: _ } => {
            let busy = std::fs::read_dir(cli.run_dir.join("sandboxes"))
                .map(|d| d.count())
                .unwrap_or(0);
            if busy > 0 {
                eprintln!(
                    "dsec: {busy} sandbox(es) run on this node ({}): remove the template \
                     through the daemon, which knows the layers they use (`dsec template rm \
                     {name}` without --local)",
                    cli.run_dir.join("sandboxes").display()
                );
                return Ok(ExitCode::from(client::EXIT_CONFLICT));
            }
            let removed = store.remove(name, &|| std::collections::BTreeSet::new())?;
            println!("removed {name} ({} unused layer(s) deleted)", removed.len());
        }
        TemplateCmd::Push(_) => anyhow::bail!("`template push` talks to the daemon"),
        TemplateCmd::Build(_) => anyhow::bail!("`template build` talks to the daemon"),
    }
    Ok(ExitCode::SUCCESS)
}

fn template_rm(c: &client::Client, name: &str) -> Result<ExitCode, client::ClientError> {
    c.send(
        "DELETE",
        &format!("/v1/templates/{}", client::seg(name)),
        &[],
        client::Body::Empty,
        &[],
    )?;
    println!("removed {name}");
    Ok(ExitCode::SUCCESS)
}

/// The IPv4 addresses of a cluster's etcd endpoints (comma-separated URLs): no sandbox's
/// egress ever reaches them.
fn etcd_addrs(urls: &str) -> Vec<(std::net::Ipv4Addr, u8)> {
    use std::net::ToSocketAddrs;
    let mut out = Vec::new();
    for u in urls.split(',') {
        let hostport = u
            .trim()
            .split_once("://")
            .map_or(u.trim(), |(_, rest)| rest)
            .split('/')
            .next()
            .unwrap_or_default();
        let with_port = if hostport.contains(':') {
            hostport.to_owned()
        } else {
            format!("{hostport}:2379")
        };
        for a in with_port.to_socket_addrs().into_iter().flatten() {
            if let std::net::IpAddr::V4(v4) = a.ip() {
                out.push((v4, 32));
            }
        }
    }
    out
}

/// `a.b.c.d/len`, len 16..=28 (room for sandboxes, not a whole class A).
fn parse_subnet(s: &str) -> Result<(std::net::Ipv4Addr, u8), String> {
    let (a, l) = s.split_once('/').ok_or("a.b.c.d/len")?;
    let a: std::net::Ipv4Addr = a.parse().map_err(|e| format!("{a}: {e}"))?;
    let l: u8 = l
        .parse()
        .ok()
        .filter(|l| (16..=28).contains(l))
        .ok_or("the prefix length is 16 to 28")?;
    Ok((dsec_api::network::network(a, l), l))
}

/// `a.b.c.d` or `a.b.c.d/len`.
fn parse_net(s: &str) -> Result<(std::net::Ipv4Addr, u8), String> {
    match dsec_api::network::Rule::parse(s.trim()) {
        Ok(dsec_api::network::Rule {
            dest: dsec_api::network::Dest::Net(a, l),
            ports: None,
        }) => Ok((a, l)),
        _ => Err(format!("{s}: a.b.c.d or a.b.c.d/len")),
    }
}

fn server(cli: &Cli, args: &ServerArgs) -> anyhow::Result<ExitCode> {
    let mut runtime = RuntimeConfig::from_env().context("locate dsec binaries")?;
    runtime.data_dir = cli.data_dir.clone();
    runtime.run_dir = cli.run_dir.clone();
    let cfg = dsec_node::server::ServerConfig {
        runtime,
        listen: args.listen,
        drain_timeout: std::time::Duration::from_secs(args.drain_seconds),
        max_sandboxes: args.max_sandboxes,
        compact_finished_after: std::time::Duration::from_secs(args.compact_finished_after),
        log_segment_bytes: args.log_segment_bytes,
        log_retention: (
            args.log_retention_hours
                .map(|h| std::time::Duration::from_secs(h.saturating_mul(3600))),
            args.log_retention_bytes,
        ),
        redact_patterns: dsec_node::server::trajectory::DEFAULT_PATTERNS
            .iter()
            .map(|p| (*p).to_owned())
            .chain(args.redact.iter().cloned())
            .collect(),
        host_pool: (args.pool_max > 0).then_some(dsec_node::server::PoolSize {
            min: args.pool_min.min(args.pool_max),
            max: args.pool_max,
        }),
        run: {
            let base = dsec_node::server::run::RunConfig::default();
            dsec_node::server::run::RunConfig {
                preload: args.run_preload.clone().unwrap_or(base.preload),
                zygotes: args.run_zygotes.clamp(1, 256),
                zygotes_max: args
                    .run_zygotes_max
                    .clamp(args.run_zygotes.clamp(1, 256), 1024),
                retire_after: std::time::Duration::from_secs(args.run_zygote_idle_secs.max(1)),
                pids_max: args.run_pids_max.clamp(16, 1 << 20),
                userns: args.run_userns,
                anonymous: args.anonymous_run,
                template: args.run_template.clone(),
            }
        },
        shutdown_sandboxes: args.shutdown_sandboxes,
        vm_cache_max_bytes: args.vm_cache_max_bytes,
        egress: dsec_node::egress::EgressConfig {
            resolver: args.egress_resolver,
            subnet: args.egress_subnet,
            never: args
                .etcd
                .as_deref()
                .map(etcd_addrs)
                .unwrap_or_default()
                .into_iter()
                .chain(args.egress_never.iter().copied())
                .collect(),
        },
        cluster: args
            .etcd
            .clone()
            .map(|etcd| dsec_node::member::ClusterConfig {
                etcd,
                name: args.node_name.clone().unwrap_or_default(),
                advertise: args.advertise.clone().unwrap_or_default(),
                template_store: args.template_store.clone(),
            }),
    };
    let key_file = cli.data_dir.join("admin.key");
    dsec_node::server::run(cfg, move |addr, key| {
        let mut out = std::io::stdout().lock();
        if let Some(key) = key {
            let _ = writeln!(out, "admin api key: {key}");
            let _ = writeln!(out, "(also saved in {})", key_file.display());
        }
        let _ = writeln!(out, "dsec server listening on http://{addr}");
        let _ = out.flush();
    })
    .context("dsec server (it needs root)")?;
    Ok(ExitCode::SUCCESS)
}

/// Runs a command of the daemon's client; its failures print a hint and map to documented exit
/// codes (`client::EXIT_CODES`).
fn remote(
    cli: &Cli,
    f: impl FnOnce(&client::Client) -> Result<ExitCode, client::ClientError>,
) -> ExitCode {
    let key = cli.api_key.clone().or_else(|| {
        std::fs::read_to_string(cli.data_dir.join("admin.key"))
            .ok()
            .map(|k| k.trim().to_owned())
            .filter(|k| !k.is_empty())
    });
    match f(&client::Client::new(&cli.url, key)) {
        Ok(code) => code,
        Err(e) => {
            client::report(&e, "");
            ExitCode::from(e.exit_code())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Sandbox { command } => return remote(&cli, |c| sandbox_cmd::run(c, command)),
        Command::Pool { command } => return remote(&cli, |c| admin_cmd::pool(c, command)),
        Command::Snapshot { command } => return remote(&cli, |c| snapshot_cmd::run(c, command)),
        Command::Tenant { command } => return remote(&cli, |c| admin_cmd::tenant(c, command)),
        Command::Trajectory { command } => {
            return remote(&cli, |c| trajectory_cmd::run(c, command))
        }
        Command::Server(args) => server(&cli, args),
        Command::Gateway(args) => cluster_cmd::gateway(args),
        Command::Cluster { command } => cluster_cmd::run(command),
        Command::Run(args) => run(&cli, args),
        Command::Vm { command } => vm(&cli, command),
        Command::Template {
            command:
                TemplateCmd::Push(TemplateSource {
                    name,
                    path,
                    rootfs,
                    oci,
                }),
        } => match archive_format(path, *rootfs, *oci) {
            Ok(format) => return remote(&cli, |c| template_push(c, name, path, format)),
            Err(e) => Err(e),
        },
        Command::Template {
            command: TemplateCmd::Rm { name, local: false },
        } => return remote(&cli, |c| template_rm(c, name)),
        Command::Template {
            command: TemplateCmd::Build(args),
        } => return remote(&cli, |c| build_cmd::run(c, args)),
        Command::Template { command } => template(&cli, command),
        Command::Bench(args) => bench::run(args, &cli.data_dir, || runtime(&cli)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dsec: {e:#}");
            ExitCode::from(local_exit_code(&e))
        }
    }
}

/// The exit code of a failure of a command that runs here (`run`, `template`, `vm`, `server`):
/// the code of the runtime or template error in its chain, mapped by the table of the daemon's
/// commands (a missing template exits 3, an invalid image 2), else 70.
fn local_exit_code(e: &anyhow::Error) -> u8 {
    use dsec_node::substrate::RuntimeError;
    use dsec_node::template::TemplateError;
    e.chain()
        .find_map(|cause| {
            cause
                .downcast_ref::<RuntimeError>()
                .map(RuntimeError::code)
                .or_else(|| {
                    cause
                        .downcast_ref::<TemplateError>()
                        .map(TemplateError::code)
                })
        })
        .and_then(client::exit_for_code)
        .unwrap_or(client::EXIT_INTERNAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_endpoints_are_never_reached() {
        let a = etcd_addrs("http://10.1.2.3:2379, https://192.0.2.9/x,127.0.0.1");
        assert_eq!(
            a,
            vec![
                (std::net::Ipv4Addr::new(10, 1, 2, 3), 32),
                (std::net::Ipv4Addr::new(192, 0, 2, 9), 32),
                (std::net::Ipv4Addr::new(127, 0, 0, 1), 32),
            ]
        );
        assert_eq!(
            parse_subnet("10.9.8.7/20"),
            Ok((std::net::Ipv4Addr::new(10, 9, 0, 0), 20))
        );
        assert!(parse_subnet("10.0.0.0/8").is_err());
    }
}
