#!/usr/bin/env node
// An agent-like workload for pvisor's memory study, run in the Linux guest from the image that
// scripts/agent-rootfs.sh builds (at /opt/agent/agent.js, with Debian's nodejs and node-typescript).
//
// As an AI agent does, it loads a large library (the TypeScript compiler), does real work with it
// (compiles the small project beside it through the compiler API, type check and emit in memory)
// and keeps what it built on its heap (the program, its ASTs and checker, the outputs), as an agent
// keeps its context. It then prints one line:
//   ready compiled N files in X ms, heap Y MiB, rss Z MiB (typescript V loaded in L ms, ...)
// and idles the way an agent waits for a model's reply: asleep, with a timer now and then.
// Requests are lines on stdin, each answered by one JSON line on stdout:
//   status  the heap and process figures
//   work    compile the project once more, from scratch, and keep the new program
//   exit    answer, then exit 0
// When stdin ends (pvisor run gives /dev/null) it keeps idling until it is killed.
//
//   node agent.js [--project DIR]     (default: the project/ folder beside this file)
'use strict';
const path = require('node:path');
const { performance } = require('node:perf_hooks');

const TICK_MS = 10_000;
// Requests are short words: a longer line is refused without being kept.
const MAX_REQUEST_BYTES = 1024;
const MiB = 2 ** 20;

function parseArgs(argv) {
  let project = path.join(__dirname, 'project');
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--project' && i + 1 < argv.length) project = path.resolve(argv[++i]);
    else fail(`unexpected argument ${JSON.stringify(argv[i])}; usage: node agent.js [--project DIR]`);
  }
  return { project };
}

function fail(message) {
  process.stderr.write(`agent: ${message}\n`);
  process.exit(1);
}

const args = parseArgs(process.argv.slice(2));
const loadStart = performance.now();
const ts = require('typescript');
const loadMs = performance.now() - loadStart;

/** Type checks and emits the project, in memory; throws with the compiler's messages on any error. */
function compile(projectDir) {
  const t0 = performance.now();
  const configPath = path.join(projectDir, 'tsconfig.json');
  const host = { getCanonicalFileName: (f) => f, getCurrentDirectory: () => projectDir, getNewLine: () => '\n' };
  const read = ts.readConfigFile(configPath, ts.sys.readFile);
  if (read.error) throw new Error(ts.formatDiagnostics([read.error], host));
  const parsed = ts.parseJsonConfigFileContent(read.config, ts.sys, projectDir, undefined, configPath);
  if (parsed.errors.length) throw new Error(ts.formatDiagnostics(parsed.errors, host));
  if (!parsed.fileNames.length) throw new Error(`${configPath} names no file`);
  const program = ts.createProgram({ rootNames: parsed.fileNames, options: parsed.options });
  const outputs = new Map();
  const emitted = program.emit(undefined, (name, text) => outputs.set(name, text));
  const diagnostics = [...ts.getPreEmitDiagnostics(program), ...emitted.diagnostics];
  if (diagnostics.length) throw new Error(ts.formatDiagnostics(diagnostics, host));
  return {
    program,
    // The checker holds the resolved types: an agent's language tooling keeps it too.
    checker: program.getTypeChecker(),
    outputs,
    files: parsed.fileNames.length,
    sourceFiles: program.getSourceFiles().length,
    ms: performance.now() - t0,
  };
}

function figures() {
  const m = process.memoryUsage();
  return { heapUsedBytes: m.heapUsed, heapTotalBytes: m.heapTotal, rssBytes: m.rss, externalBytes: m.external };
}

const mib = (bytes) => (bytes / MiB).toFixed(1);

let context;
try {
  context = compile(args.project);
} catch (e) {
  fail(`cannot compile ${args.project}:\n${e.message}`);
}
const started = performance.now();
let ticks = 0;
let requests = 0;
{
  const f = figures();
  process.stdout.write(
    `ready compiled ${context.files} files in ${context.ms.toFixed(0)} ms, heap ${mib(f.heapUsedBytes)} MiB, rss ${mib(f.rssBytes)} MiB ` +
      `(typescript ${ts.version} loaded in ${loadMs.toFixed(0)} ms, ${context.sourceFiles} files with the libs, ${context.outputs.size} outputs, node ${process.version})\n`,
  );
}

// The wait for a model's reply: nothing to do but notice, now and then, that time has passed.
setInterval(() => {
  ticks++;
}, TICK_MS);

function answer(request) {
  requests++;
  switch (request) {
    case 'status':
      return { status: 'idle', ...figures(), files: context.files, sourceFiles: context.sourceFiles, outputs: context.outputs.size, ticks, requests, uptimeMs: Math.round(performance.now() - started) };
    case 'work': {
      // The new program replaces the old one, which becomes garbage: the heap holds one context.
      context = compile(args.project);
      return { work: 'compiled', files: context.files, ms: Math.round(context.ms), ...figures() };
    }
    case 'exit':
      return { exit: 0 };
    default:
      return { error: `unknown request ${JSON.stringify(request.slice(0, 64))}; expected status, work or exit` };
  }
}

function send(reply, then) {
  process.stdout.write(`${JSON.stringify(reply)}\n`, then);
}

let exiting = false;
function handle(line) {
  const request = line.trim();
  // After exit nothing more is answered, even what came in the same read.
  if (!request || exiting) return;
  if (request === 'exit') {
    exiting = true;
    process.stdin.pause();
  }
  let reply;
  try {
    reply = answer(request);
  } catch (e) {
    reply = { error: e instanceof Error ? e.message : String(e) };
  }
  send(reply, () => {
    if (request === 'exit') process.exit(0);
  });
}

const tooLong = () => send({ error: `a request is at most ${MAX_REQUEST_BYTES} bytes` });
let pending = '';
let discarding = false;
process.stdin.setEncoding('utf8');
process.stdin.on('data', (chunk) => {
  let rest = chunk;
  for (let nl = rest.indexOf('\n'); nl >= 0; nl = rest.indexOf('\n')) {
    const line = pending + rest.slice(0, nl);
    rest = rest.slice(nl + 1);
    pending = '';
    if (discarding) discarding = false;
    else if (Buffer.byteLength(line) > MAX_REQUEST_BYTES) {
      if (!exiting) tooLong();
    }
    else handle(line);
  }
  if (discarding) return;
  pending += rest;
  if (Buffer.byteLength(pending) > MAX_REQUEST_BYTES) {
    pending = '';
    discarding = true;
    if (!exiting) tooLong();
  }
});
process.stdin.on('end', () => process.stderr.write('agent: stdin ended; idling until killed\n'));
