/**
 * The fetch socket of the userfaultfd server (native-prebuilds/helpers/uffd_server.c, deferred
 * sources): the records the server and a fetcher exchange, as pv_records (pv_record.h; tag =
 * source id, value = range index). Pure constants, apart from the binding, so that a fetcher in a
 * worker thread can use them without loading native code (a worker must not load ffi-rs).
 * @module
 */

/** pv_record.kind on the fetch socket (enum pv_fetch_record_kind). */
export const FetchRecord = {
  /** Server to fetcher: a fault waits in this absent range. */
  want: 1,
  /** Fetcher to server: the range's bytes are in the file. */
  ready: 2,
  /** Fetcher to server: they never will be; err says why ({@link FetchFailure}). */
  failed: 3,
} as const;

/**
 * pv_record.err of a FAILED record: the fetcher's reasons (below the server's own, -1 to -4,
 * enum pv_load_error), which the server passes on in its source error record.
 */
export const FetchFailure = {
  /** The server's own: the fetcher is gone, or its socket is full. */
  gone: -4,
  /** The chunk's bytes do not have the SHA-256 that names them. */
  corrupt: -5,
  /** The store did not answer within the request timeout. */
  timeout: -6,
  /** The store refused or failed the request. */
  unreachable: -7,
  /** The chunk could not be kept on this host (its cache or scratch file). */
  local: -8,
} as const;

/** Why a range failed, from a FAILED record's err (for messages). */
export function fetchFailureWhy(err: number): string | undefined {
  switch (err) {
    case FetchFailure.gone:
      return 'the chunk fetcher is gone';
    case FetchFailure.corrupt:
      return "the chunk fetched does not have the SHA-256 that names it";
    case FetchFailure.timeout:
      return 'the object store did not answer in time';
    case FetchFailure.unreachable:
      return 'the object store failed the request';
    case FetchFailure.local:
      return 'the chunk could not be kept on this host';
    default:
      return undefined;
  }
}
