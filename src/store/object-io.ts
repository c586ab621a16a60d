/**
 * The few S3 calls a snapshot needs (HeadObject, PutObject, GetObject), each bounded in time by
 * an abort signal that covers the whole call, its retries and the reading of its body, so a store
 * that stops answering is a {@link StoreError} `timeout`, never a hang; and each read bounded in
 * size before and while its body is read. S3's failures become {@link StoreError}s by kind.
 */
import { GetObjectCommand, HeadObjectCommand, PutObjectCommand, S3Client, S3ServiceException } from '@aws-sdk/client-s3';
import { StoreError } from '../errors';
import type { StoreUrl } from './store-url';

/** The default {@link ObjectStore} request timeout: 30 s, a 2 MiB chunk over a slow link with retries. */
export const DEFAULT_REQUEST_TIMEOUT_MS = 30_000;

/** One bucket, through one client, every call bounded by `requestTimeoutMs`. */
export class ObjectStore {
  private constructor(
    readonly client: S3Client,
    private readonly ownsClient: boolean,
    readonly bucket: string,
    readonly requestTimeoutMs: number,
  ) {}

  /**
   * A store for `url`'s bucket. Without `client`, one configured from the standard AWS
   * environment and config files (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_REGION, profiles...),
   * with connection and socket timeouts of its own below `requestTimeoutMs`.
   */
  static open(url: StoreUrl, options: { client?: S3Client; requestTimeoutMs: number }): ObjectStore {
    const { requestTimeoutMs } = options;
    if (options.client) return new ObjectStore(options.client, false, url.bucket, requestTimeoutMs);
    const client = new S3Client({
      requestHandler: { connectionTimeout: Math.min(5000, requestTimeoutMs), requestTimeout: requestTimeoutMs },
    });
    return new ObjectStore(client, true, url.bucket, requestTimeoutMs);
  }

  /** Ends the client's connections, if this store made it. */
  close(): void {
    if (this.ownsClient) this.client.destroy();
  }

  /** The size of object `key`, or undefined when there is none. */
  async sizeOf(key: string): Promise<number | undefined> {
    return this.bounded(`HEAD ${key}`, async (abortSignal) => {
      try {
        const r = await this.client.send(new HeadObjectCommand({ Bucket: this.bucket, Key: key }), { abortSignal });
        return r.ContentLength ?? 0;
      } catch (e) {
        if (statusOf(e) === 404) return undefined;
        throw e;
      }
    });
  }

  /** Writes `body` as `key`; `createOnly`: refused (a {@link StoreError} `exists`) if `key` exists. */
  async put(key: string, body: Buffer, createOnly = false): Promise<void> {
    await this.bounded(`PUT ${key}`, (abortSignal) =>
      this.client.send(new PutObjectCommand({ Bucket: this.bucket, Key: key, Body: body, ContentLength: body.length, ...(createOnly && { IfNoneMatch: '*' }) }), { abortSignal }),
    );
  }

  /**
   * Reads object `key` whole, refusing it (a {@link StoreError} `malformed`, or `corrupt` when
   * `exactBytes`) when it is larger than `maxBytes` before reading it, or grows past it while read.
   * No object is a {@link StoreError} `not-found`.
   */
  async get(key: string, maxBytes: number, exactBytes = false): Promise<Buffer> {
    return this.bounded(`GET ${key}`, async (abortSignal) => {
      const r = await this.client.send(new GetObjectCommand({ Bucket: this.bucket, Key: key }), { abortSignal });
      // A body that stops half-way ends with the call's bound, not with the socket's (a client
      // given by the user may have no socket timeout at all).
      abortSignal.addEventListener('abort', () => (r.Body as { destroy?: () => void } | undefined)?.destroy?.(), { once: true });
      const reason = exactBytes ? 'corrupt' : 'malformed';
      const tooLarge = (n: number): StoreError => new StoreError(reason, `s3://${this.bucket}/${key}: ${n} bytes or more, ${exactBytes ? 'not the' : 'more than the'} ${maxBytes} it ${exactBytes ? 'must have' : 'may have'}`);
      if (r.ContentLength !== undefined && r.ContentLength > maxBytes) {
        (r.Body as { destroy?: () => void } | undefined)?.destroy?.();
        throw tooLarge(r.ContentLength);
      }
      const parts: Buffer[] = [];
      let total = 0;
      for await (const part of r.Body as AsyncIterable<Uint8Array>) {
        total += part.length;
        if (total > maxBytes) {
          (r.Body as { destroy?: () => void }).destroy?.();
          throw tooLarge(total);
        }
        parts.push(Buffer.from(part.buffer, part.byteOffset, part.length));
      }
      return Buffer.concat(parts, total);
    });
  }

  /**
   * Runs `call` with a signal that aborts it after {@link requestTimeoutMs}, and maps what it
   * throws: the abort to `timeout`, 404 to `not-found`, 412 to `exists`, anything else from the
   * store or the network to `unreachable`. A {@link StoreError} passes through. Not private:
   * the claim of a hibernated VM (claim.ts) makes conditional calls of its own through it.
   */
  async bounded<T>(what: string, call: (signal: AbortSignal) => Promise<T>): Promise<T> {
    const controller = new AbortController();
    let timer: NodeJS.Timeout | undefined;
    const timedOut = new Promise<never>((_, reject) => {
      timer = setTimeout(() => {
        controller.abort();
        reject(new StoreError('timeout', `s3://${this.bucket}: ${what} had no answer in ${this.requestTimeoutMs} ms`));
      }, this.requestTimeoutMs);
    });
    const work = call(controller.signal);
    // What the aborted call throws later is the same failure, already reported.
    work.catch(() => undefined);
    try {
      return await Promise.race([work, timedOut]);
    } catch (e) {
      if (e instanceof StoreError) throw e;
      // The client's own socket timeouts (set below the bound when pvisor made the client) are the same failure.
      const timedOutHere = controller.signal.aborted || (e as Error).name === 'TimeoutError' || (e as NodeJS.ErrnoException).code === 'ETIMEDOUT';
      if (timedOutHere) throw new StoreError('timeout', `s3://${this.bucket}: ${what} had no answer in ${this.requestTimeoutMs} ms`, { cause: e });
      const status = statusOf(e);
      if (status === 404) throw new StoreError('not-found', `s3://${this.bucket}: ${what}: no such object`, { cause: e });
      if (status === 412) throw new StoreError('exists', `s3://${this.bucket}: ${what}: the object exists already`, { cause: e });
      const detail = status ? `HTTP ${status} ${(e as Error).name}` : ((e as NodeJS.ErrnoException).code ?? (e as Error).name);
      throw new StoreError('unreachable', `s3://${this.bucket}: ${what} failed (${detail}: ${(e as Error).message})`, { cause: e });
    } finally {
      clearTimeout(timer);
    }
  }
}

function statusOf(e: unknown): number | undefined {
  if (e instanceof S3ServiceException) return e.$metadata.httpStatusCode;
  return (e as { $metadata?: { httpStatusCode?: number } } | undefined)?.$metadata?.httpStatusCode;
}

/**
 * Runs `work` on each of `items`, at most `concurrency` at once, in order of start. The first
 * failure stops new work from starting and is thrown once the running ones have settled.
 */
export async function eachBounded<T>(items: readonly T[], concurrency: number, work: (item: T, index: number) => Promise<void>): Promise<void> {
  let next = 0;
  let failure: { error: unknown } | undefined;
  const worker = async (): Promise<void> => {
    while (!failure && next < items.length) {
      const i = next++;
      try {
        await work(items[i], i);
      } catch (e) {
        failure ??= { error: e };
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(concurrency, items.length) }, worker));
  if (failure) throw failure.error;
}
